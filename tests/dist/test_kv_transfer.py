"""KV blocks between two processes that share no torch.distributed world, as a prefill and a
decode replica's ranks: each layer's blocks gathered, sent, received and scattered into
other block ids arrive exact (float32 and int8 caches), several transfers in flight at once
and posted in opposite orders; a receive nobody answers times out with an error; a peer that
starts again pairs anew with the rank that stayed (which exits cleanly, without closing its
transport by hand, as a rank does)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from meshserve.comm.kv_transfer import TorchKvTransport, gather_blocks, layer_tag, scatter_blocks
from meshserve.launcher.network import free_port

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 12, 4, 2, 8


def caches(dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BLOCK, HEADS, DIM)
    if dtype == torch.int8:
        return [(torch.randint(-128, 127, shape, generator=g, dtype=torch.int8),
                 torch.randint(-128, 127, shape, generator=g, dtype=torch.int8)) for _ in range(LAYERS)]
    return [(torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype))
            for _ in range(LAYERS)]


SENT = {1: [3, 7, 1], 2: [0, 11]}
"""transfer -> the prefill side's blocks of its sequence ..."""
INTO = {1: [5, 2, 9], 2: [10, 4]}
"""... and the decode side's, where they land."""


def side(role: str, port: int, dtype, out) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=role == "prefill", wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        me, peer = ("replica0/rank0", "replica1/rank0") if role == "prefill" else ("replica1/rank0", "replica0/rank0")
        transport = TorchKvTransport(me, store, timeout_s=5)
        kv = caches(dtype, seed=0 if role == "prefill" else 1)
        pending = []
        transfers = [1, 2] if role == "prefill" else [2, 1]  # posted in opposite orders
        staged = {}
        for transfer in transfers:
            for layer in range(LAYERS):
                tag = layer_tag(transfer, layer, LAYERS)
                if role == "prefill":
                    pending.append(transport.send(peer, tag, gather_blocks(kv[layer], SENT[transfer])))
                else:
                    staged[transfer, layer] = torch.empty((2, len(INTO[transfer]), BLOCK, HEADS, DIM), dtype=dtype)
                    pending.append(transport.recv(peer, tag, staged[transfer, layer]))
        for p in pending:
            p.wait()
        if role == "decode":
            for (transfer, layer), stacked in staged.items():
                scatter_blocks(kv[layer], INTO[transfer], stacked)
            untouched = [b for b in range(BLOCKS) if b not in INTO[1] + INTO[2]]
            out.put(("decode", [tuple(t.clone() for t in layer) for layer in kv], untouched))
            try:
                transport.recv(peer, layer_tag(9, 0, LAYERS), torch.empty(4)).wait()  # nobody sends this
                out.put(("timeout", None))
            except RuntimeError as e:
                out.put(("timeout", str(e)))
        else:
            out.put(("prefill", [tuple(t.clone() for t in layer) for layer in kv], None))
            store.wait(["decode-done"], datetime.timedelta(seconds=30))
        if role == "decode":
            store.set("decode-done", "1")
        transport.close()
    except Exception:
        out.put(("error", traceback.format_exc()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_blocks_travel_layer_by_layer_into_other_block_ids(dtype):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=side, args=(role, port, dtype, out)) for role in ("prefill", "decode")]
    for p in procs:
        p.start()
    got = {}
    for _ in range(3):
        kind, value, *rest = out.get(timeout=120)
        assert kind != "error", value
        got[kind] = (value, *rest)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    sent, _ = got["prefill"]
    received, untouched = got["decode"]
    before = caches(dtype, seed=1)
    for layer in range(LAYERS):
        for transfer in (1, 2):
            for src, dst in zip(SENT[transfer], INTO[transfer]):
                assert torch.equal(received[layer][0][dst], sent[layer][0][src])
                assert torch.equal(received[layer][1][dst], sent[layer][1][src])
        for b in untouched:
            assert torch.equal(received[layer][0][b], before[layer][0][b])
    message = got["timeout"][0]
    assert message is not None and ("imeout" in message or "imed out" in message), message


def decode_side_that_stays(port: int, out) -> None:
    """The decode rank: pairs with the prefill rank, watches for it starting again, and
    receives one tensor from each of its two lives."""
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        transport = TorchKvTransport("replica1/rank0", store, timeout_s=20)
        transport.connect("replica0/rank0")
        transport.watch(["replica0/rank0"], every_s=0.1)
        for life in (1, 2):
            got = torch.empty(4)
            deadline = time.monotonic() + 60
            while True:  # a receive posted on the dead pair fails (as a transfer does); the next is posted anew
                try:
                    transport.recv("replica0/rank0", life, got).wait()
                    break
                except RuntimeError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            out.put(("decode", life, got.tolist()))
        store.wait(["prefill-2-done"], datetime.timedelta(seconds=60))
    except Exception:
        out.put(("error", traceback.format_exc(), None))


def prefill_side_that_dies(port: int, life: int, out) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        transport = TorchKvTransport("replica0/rank0", store, timeout_s=20)
        transport.connect("replica1/rank0")
        transport.send("replica1/rank0", life, torch.full((4,), float(life))).wait()
        out.put(("prefill", life, None))
        if life == 2:
            store.set("prefill-2-done", "1")
    except Exception:
        out.put(("error", traceback.format_exc(), None))


def test_a_peer_that_starts_again_pairs_anew_with_the_rank_that_stayed():
    """The store is a third process's, as the front door hosts it for the replicas."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    decode = ctx.Process(target=decode_side_that_stays, args=(port, out))
    decode.start()
    first = ctx.Process(target=prefill_side_that_dies, args=(port, 1, out))
    first.start()
    got = [out.get(timeout=120) for _ in range(2)]
    assert all(kind != "error" for kind, *_ in got), got
    first.join(30)
    first.kill()  # its group's other end is gone now
    second = ctx.Process(target=prefill_side_that_dies, args=(port, 2, out))
    second.start()
    got += [out.get(timeout=120) for _ in range(2)]
    assert all(kind != "error" for kind, *_ in got), got
    assert sorted((k, life, v) for k, life, v in got if k == "decode") == [("decode", 1, [1.0] * 4),
                                                                          ("decode", 2, [2.0] * 4)]
    for p in (second, decode):
        p.join(60)
        assert p.exitcode == 0
    del store
