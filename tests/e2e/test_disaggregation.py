"""Disaggregated prefill/decode (`parallel.data=2`, `disaggregation.prefill_replicas=1`):
replica 0 computes prompts, replica 1 decodes, the KV blocks cross between their ranks.

- SmolLM2 at tp=1 and tp=2 inside each replica: greedy tokens equal transformers' for
  concurrent requests and a conversation's second turn, whose prefix the decode replica
  already holds (not sent again: fewer bytes, cached tokens in the usage); the decode
  replica never computed a prompt token.
- int8 KV cache: the same tokens as one replica with the same config (in this process).
- The prefill replica killed while a long prompt computes: that request starts over on the
  decode replica, the stream already decoding finishes, both with an undisturbed run's
  tokens; the prefill replica is started again, pairs anew and computes prompts again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from meshserve.client import Client, MeshserveError
from support.deployments import chat_ids, generate_concurrently, replica_process, samples, serve
from support.reference import hf_greedy
from support.server import alive

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?"]
DISAGG = ("parallel.data=2", "disaggregation.prefill_replicas=1")


def _kv_metric(url: str, name: str, label: str) -> dict[str, float]:
    """{replica: value} of a replica's KV-transfer gauge with `label`, through the front door."""
    found = samples(httpx.get(f"{url}/metrics", timeout=30).text, name)
    return {next(x for x in k if x.startswith("replica=")).split('"')[1]: v for k, v in found.items() if label in k}


def _check_against_transformers(address: str, url: str, reference, prompts: list[list[int]]) -> None:
    """Concurrent requests, then a conversation's second turn, against transformers' greedy
    tokens; the second turn's prefix is on the decode replica and does not cross again."""
    results = generate_concurrently(address, prompts, 10)
    for i, prompt in enumerate(prompts):
        want = hf_greedy(reference, prompt, 10)
        cut = want.index(2) + 1 if 2 in want else len(want)
        assert results[i] == want[:cut], i
    turns, sent = [], []
    conversation = list(prompts[0]) + list(range(300, 330))
    with Client(address, timeout=180) as client:
        for tail in (list(range(400, 420)), list(range(500, 540))):
            before = _kv_metric(url, "meshserve_kv_transfer_bytes", 'direction="sent"')["0"]
            out = client.generate(conversation, max_tokens=12, temperature=0, ignore_eos=True)
            sent.append(_kv_metric(url, "meshserve_kv_transfer_bytes", 'direction="sent"')["0"] - before)
            assert out.token_ids == hf_greedy(reference, conversation, 12)
            turns.append((len(conversation), out.usage.cached_tokens))
            conversation = conversation + out.token_ids + tail
    (first_len, _), (second_len, cached) = turns
    assert cached >= first_len // 16 * 16  # the first turn's blocks, held by the decode replica ...
    blocks = [-(-n // 16) - c // 16 for n, c in turns]
    assert sent[1] * blocks[0] == sent[0] * blocks[1], (sent, blocks)  # ... so only the blocks after them crossed
    landed = _kv_metric(url, "meshserve_kv_transfers", 'outcome="landed"')
    assert landed == {"0": 0, "1": len(prompts) + 2}, landed
    computed = samples(httpx.get(f"{url}/metrics", timeout=30).text, "meshserve_prompt_tokens_computed_total")
    assert computed[('replica="1"',)] == 0 and computed[('replica="0"',)] > 100, computed


@pytest.mark.slow
def test_prefill_and_decode_replicas_serve_transformers_tokens(tmp_path, smollm2_reference):
    from support.checkpoints import smollm2_tokenizer

    tok = smollm2_tokenizer()
    server, address, url = serve(tmp_path, "disagg", *DISAGG)
    try:
        _check_against_transformers(address, url, smollm2_reference,
                                    [chat_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS])
        assert server.stop() == 0, server.tail()
        assert not server.group_alive() and not server.descendants()
    finally:
        server.kill()


@pytest.mark.slow
def test_prefill_and_decode_replicas_of_two_tensor_parallel_ranks(tmp_path, tiny_checkpoints):
    from support.reference import hf_model

    path = tiny_checkpoints["llama"]
    server, address, url = serve(tmp_path, "disagg-tp2", *DISAGG, "parallel.tensor=2", f"model.path={path}")
    try:
        _check_against_transformers(address, url, hf_model(path), [list(range(10 + i, 50 + 7 * i)) for i in range(3)])
        assert server.stop() == 0, server.tail()
        assert not server.group_alive() and not server.descendants()
    finally:
        server.kill()


@pytest.mark.slow
def test_an_int8_kv_cache_crosses_as_it_is(tmp_path, smollm2):
    """Against one replica with the same config: the engine in this process."""
    from meshserve.comm.messages import SamplingParams
    from meshserve.engine.offline import generate
    from support.checkpoints import smollm2_tokenizer
    from support.engines import make_engine

    tok = smollm2_tokenizer()
    prompts = [chat_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    server, address, _ = serve(tmp_path, "int8-disagg", "cache.dtype=int8", *DISAGG)
    try:
        with Client(address, timeout=180) as client:
            got = [client.generate(p, max_tokens=10, temperature=0).token_ids for p in prompts]
        assert server.stop() == 0, server.tail()
    finally:
        server.kill()
    one = make_engine(smollm2, "cache.dtype=int8", "model.max_model_len=512")
    want = [generate(one, [p], [SamplingParams(max_tokens=10, temperature=0)])[0].token_ids for p in prompts]
    assert got == want


def _stream(address: str, prompt: list[int], max_tokens: int, started: threading.Event, outcome: dict) -> None:
    with Client(address, timeout=180) as client:
        try:
            tokens = []
            for delta in client.generate(prompt, stream=True, max_tokens=max_tokens, ignore_eos=True, temperature=0):
                tokens += delta.token_ids
                started.set()
            outcome["tokens"] = tokens
        except MeshserveError as e:
            outcome["error"] = (e.code, str(e))
            started.set()


@pytest.mark.slow
def test_a_killed_prefill_replica_loses_no_request_and_is_started_again(tmp_path):
    """The prefill replica SIGKILLed while a long prompt (1,500 tokens) computes: that request starts over
    and, with no prefill replica serving, the decode replica computes it itself; the stream
    already decoding finishes; both have the tokens of an undisturbed run. The prefill
    replica is started again within 60 s, pairs anew with the decode replica's ranks, and
    computes prompts again (the decode replica none)."""
    shm_before = {p.name for p in Path("/dev/shm").glob("meshserve-*")}
    server, address, url = serve(tmp_path, "disagg-kill", *DISAGG, "model.max_model_len=2048",
                                 "scheduler.max_batched_tokens=256", "router.restart_backoff=0.2")
    try:
        prefill = replica_process(server, 0)  # world size 1: the replica's process is its rank
        decoding = {}
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(address, list(range(100, 140)), 200, started, decoding), daemon=True)
        t.start()
        assert started.wait(60)
        long = {}
        long_started = threading.Event()
        threading.Thread(target=_stream, args=(address, list(range(1000, 2500)), 4, long_started, long),
                         daemon=True).start()
        time.sleep(1.0)  # its prompt computes on replica 0, in chunks of 256 tokens
        killed = time.monotonic()
        os.kill(prefill, signal.SIGKILL)
        assert long_started.wait(120)
        t.join(180)
        assert "error" not in long and "error" not in decoding, (long, decoding)
        assert len(long["tokens"]) == 4 and len(decoding["tokens"]) == 200
        assert "prefill replica 0 failed: killed by SIGKILL" in server.tail(1 << 20)  # it was computing the prompt
        while (health := httpx.get(f"{url}/health", timeout=5).json())["status"] != "ok":
            assert time.monotonic() - killed < 60, health
            time.sleep(0.2)
        assert health["replicas"]["each"][0] == {"replica": 0, "state": "serving", "restarts": 1}, health
        assert not alive([prefill])
        computed = samples(httpx.get(f"{url}/metrics", timeout=30).text, "meshserve_prompt_tokens_computed_total")
        with Client(address, timeout=180) as client:  # undisturbed, through the prefill replica started again
            again = [client.generate(p, max_tokens=n, ignore_eos=True, temperature=0).token_ids
                     for p, n in ((list(range(1000, 2500)), 4), (list(range(100, 140)), 200))]
        assert again == [long["tokens"], decoding["tokens"]]
        after = samples(httpx.get(f"{url}/metrics", timeout=30).text, "meshserve_prompt_tokens_computed_total")
        one, zero = ('replica="1"',), ('replica="0"',)
        assert after[one] == computed[one] and after[zero] > computed.get(zero, 0), (computed, after)
        assert server.stop() == 0, server.tail()
        assert not server.group_alive() and not server.descendants()
        assert {p.name for p in Path("/dev/shm").glob("meshserve-*")} <= shm_before
    finally:
        server.kill()
