"""Two ranks' KvAgents (engine/kv_agent.py) in two processes that share no torch.distributed
world, as a prefill and a decode replica's: a prompt computed in two chunks sends each
message of blocks in the step that completes it, layer by layer, and lands exact in the
decode side's other block ids; a transfer whose prefill never sends fails its landing at
the timeout without breaking the pair (the next transfer lands), and ending it sends zeros
so no receive is left waiting; a request refused before any plan carried it still answers
the receives (zeros)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import time
import traceback

import torch
import torch.distributed as dist

from meshserve.comm.kv_transfer import TorchKvTransport
from meshserve.comm.messages import KvOps, KvTransfer, SamplingParams
from meshserve.engine.kv_agent import KvAgent
from meshserve.engine.mirror import MirrorSeq, ScheduledChunk
from meshserve.launcher.network import free_port

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 120, 2, 2, 4
PROMPT = 70  # 35 blocks of 2; the decode side holds the first 3: 32 sent, in 2 messages of 16
SEQ_BLOCKS = list(range(40, 75))
LANDS_IN = list(range(0, 64, 2))


def caches(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BLOCKS, BLOCK, HEADS, DIM, generator=g), torch.randn(BLOCKS, BLOCK, HEADS, DIM, generator=g))
            for _ in range(LAYERS)]


def agent(me: int, store, kv) -> KvAgent:
    transport = TorchKvTransport(f"replica{me}/rank0", store, timeout_s=3600)
    transport.connect(f"replica{1 - me}/rank0")
    return KvAgent(transport, lambda r: f"replica{r}/rank0", kv, 0, LAYERS, BLOCK, BLOCKS, torch.device("cpu"),
                   timeout=3.0)


def step(a: KvAgent, seq: MirrorSeq, start: int, num_new: int) -> bool:
    """One prefill step of `seq` as the model runner runs it."""
    due = a.due([ScheduledChunk(7, seq, start, num_new, start + num_new == PROMPT)])
    if due:
        for layer in range(LAYERS):
            a.after_layer(layer)
        a.after_step()
    return due


def prefill(port, out):
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        kv = caches(0)
        a = agent(0, store, kv)
        seq = MirrorSeq(list(range(PROMPT)), PROMPT, SEQ_BLOCKS, 0, SamplingParams())
        a.apply(KvOps(send=[KvTransfer(1, 1, 3, 32, seq_id=7)]))
        steps = [step(a, seq, 0, 30), step(a, seq, 30, 10), step(a, seq, 40, 30)]  # message 0 ends at token 38
        store.set("sent-1", "1")  # what PrefillDone tells the decode replica: land it now
        out.put(("prefill", steps, [tuple(t.numpy().copy() for t in layer) for layer in kv]))
        a.apply(KvOps(send=[KvTransfer(2, 1, 0, 3, seq_id=8)]))  # never computed: its landing times out
        store.wait(["landed-2"])
        a.apply(KvOps(end=[KvTransfer(2, 1, 0, 3, seq_id=8)]))  # ... and ending it answers the receives
        a.apply(KvOps(end=[KvTransfer(4, 1, 0, 3, seq_id=-1)]))  # refused: never in a plan
        seq3 = MirrorSeq(list(range(PROMPT)), PROMPT, SEQ_BLOCKS, 0, SamplingParams())
        a.apply(KvOps(send=[KvTransfer(3, 1, 0, 35, seq_id=9)]))
        a.due([ScheduledChunk(9, seq3, 0, PROMPT, True)])
        for layer in range(LAYERS):
            a.after_layer(layer)
        a.after_step()
        store.set("sent-3", "1")
        store.wait(["done"])
        deadline = time.monotonic() + 30  # the sends' thread counts a send once its work completes
        while a.stats.transfers_sent < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        out.put(("prefill-stats", a.stats.bytes_sent, a.stats.transfers_sent))
    except Exception:
        out.put(("error", traceback.format_exc(), None))


def decode(port, out):
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        kv = caches(1)
        a = agent(1, store, kv)
        a.apply(KvOps(receive=[KvTransfer(1, 0, 3, 32, block_ids=LANDS_IN), KvTransfer(2, 0, 0, 3, block_ids=[70, 71, 72]),
                               KvTransfer(4, 0, 0, 3, block_ids=[76, 77, 78])]))
        store.wait(["sent-1"])  # as the engine lands a transfer only once its prefill reported it sent
        a.apply(KvOps(land=[1]))
        first = a.take_landed()
        a.apply(KvOps(land=[2]))
        second = a.take_landed()
        store.set("landed-2", "1")
        a.apply(KvOps(receive=[KvTransfer(3, 0, 0, 35, block_ids=list(range(80, 115)))]))
        store.wait(["sent-3"])
        a.apply(KvOps(land=[3, 4]))
        third = a.take_landed()
        store.set("done", "1")
        out.put(("decode", (first, second, third), [tuple(t.numpy().copy() for t in layer) for layer in kv]))
    except Exception:
        out.put(("error", traceback.format_exc(), None))


def test_a_prompt_s_blocks_land_exact_and_a_transfer_that_never_comes_fails_alone():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=f, args=(port, out)) for f in (prefill, decode)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(3):
        kind, a, b = out.get(timeout=120)
        assert kind != "error", a
        got[kind] = (a, b)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    steps, sent = got["prefill"]
    sent = [tuple(torch.from_numpy(t) for t in layer) for layer in sent]
    assert steps == [False, True, True]  # a message goes once its blocks are all computed
    (first, second, third), received = got["decode"]
    received = [tuple(torch.from_numpy(t) for t in layer) for layer in received]
    assert first == {1: True} and second == {2: False} and third == {3: True, 4: True}
    for layer in range(LAYERS):
        for kv in (0, 1):
            for src, dst in zip(SEQ_BLOCKS[3:], LANDS_IN):  # transfer 1
                assert torch.equal(received[layer][kv][dst], sent[layer][kv][src])
            for src, dst in zip(SEQ_BLOCKS, range(80, 115)):  # transfer 3, after the failed one
                assert torch.equal(received[layer][kv][dst], sent[layer][kv][src])
            assert not received[layer][kv][76:79].any()  # the refused request's zeros
            assert torch.equal(received[layer][kv][70:73], caches(1)[layer][kv][70:73])  # failed: not landed
    bytes_sent, transfers_sent = got["prefill-stats"]
    assert transfers_sent == 2 and bytes_sent == (32 + 35) * LAYERS * 2 * BLOCK * HEADS * DIM * 4
