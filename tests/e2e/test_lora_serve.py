"""LoRA adapters served by `meshserve serve` (engine/lora): chosen by `model` over the
OpenAI API (the real `openai` client) and by `lora=` over ZMQ, listed by /v1/models with
their parent, loaded and unloaded at run time while requests of other adapters run, and
served sharded at tp=3 and pp=2, each request given transformers' greedy tokens with its
adapter merged (PEFT's merge_and_unload)."""

from __future__ import annotations

import concurrent.futures
import os
import re

import httpx
import openai
import pytest

from meshserve.client import Client
from support.lora import PROMPTS, adapter_settings, make_adapter
from support.server import free_port, http_server, openai_client

TOKENS = 8
KEY = "lora-test-key"


def zmq_tokens(zmq: str, requests: list[tuple[str | None, list[int]]]) -> list[list[int]]:
    """Each (adapter, prompt) request's greedy tokens over ZMQ, all in flight at once."""
    with Client(zmq) as client:
        streams = [client.generate(p, stream=True, max_tokens=TOKENS, temperature=0.0, ignore_eos=True, lora=name)
                   for name, p in requests]
        return [[t for d in s for t in d.token_ids] for s in streams]


def test_adapters_by_model_name_listed_loaded_and_unloaded_under_load(tmp_path, tiny_checkpoints, lora_adapters,
                                                                      lora_expected):
    base = tiny_checkpoints["llama-6h"]
    settings = [f"model.path={base}", *adapter_settings(lora_adapters, ["a0", "a1"], max_loras=2),
                f"server.api_key={KEY}", "scheduler.max_num_seqs=6"]
    zmq = f"tcp://127.0.0.1:{free_port()}"
    with http_server(tmp_path, *settings, zmq=zmq) as (proc, url), openai_client(url, 120, KEY) as oai:
        headers = {"Authorization": f"Bearer {KEY}"}
        models = {m.id: m for m in oai.models.list().data}
        assert set(models) >= {"a0", "a1"} and models["a0"].parent == next(iter(models))
        base_name = models["a0"].parent

        def complete(model, prompt, stream=False):
            out = oai.completions.create(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0.0, stream=stream,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
            return out if stream else out.choices[0].token_ids

        def tokens(stream):
            return [t for chunk in stream for c in chunk.choices for t in (c.token_ids or [])]

        # streams of a0, a1 and the base running (each has its first token) while a2 is loaded,
        # a1 unloaded and a3 loaded
        requests = [(["a0", "a1", None][i % 3], PROMPTS[i % 2]) for i in range(6)]
        running = [complete(name or base_name, p, stream=True) for name, p in requests]
        firsts = [next(iter(s)).choices[0].token_ids for s in running]
        load = httpx.post(f"{url}/v1/load_lora_adapter", headers=headers, timeout=60,
                          json={"lora_name": "a2", "lora_path": str(lora_adapters["a2"])})
        assert load.status_code == 200, load.text
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            later = [pool.submit(complete, "a2", p) for p in PROMPTS]
            unload = httpx.post(f"{url}/v1/unload_lora_adapter", headers=headers, timeout=60,
                                json={"lora_name": "a1"})
            assert unload.status_code == 200, unload.text
            assert httpx.post(f"{url}/v1/load_lora_adapter", headers=headers, timeout=60,
                              json={"lora_name": "a3", "lora_path": str(lora_adapters["a3"])}).status_code == 200
            for (name, p), first, stream in zip(requests, firsts, running):
                assert first + tokens(stream) == lora_expected(name, p), f"adapter {name}"
            for p, f in zip(PROMPTS, later):
                assert f.result() == lora_expected("a2", p)
        assert {m.id for m in oai.models.list().data} == {base_name, "a0", "a2", "a3"}
        with pytest.raises(openai.NotFoundError, match="a1"):
            complete("a1", PROMPTS[0])
        # over ZMQ: lora= names the adapter; four adapters through two slots
        requests = [(n, p) for p in PROMPTS for n in ["a0", "a2", "a3", None]]
        assert zmq_tokens(zmq, requests) == [lora_expected(n, p) for n, p in requests]
        metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
        for name, n in (("a0", 4), ("a2", 4), ("a3", 2)):
            assert f'meshserve_lora_requests_total{{adapter="{name}"}} {n}.0' in metrics, name
        assert f'meshserve_lora_generation_tokens_total{{adapter="a0"}} {4 * TOKENS}.0' in metrics
        assert "meshserve_lora_adapters_served 3.0" in metrics and "meshserve_lora_adapters_loaded 2.0" in metrics
        evictions = float(re.search(r"^meshserve_lora_adapter_evictions (\S+)$", metrics, re.M).group(1))
        assert evictions >= 2
        # refused with the reason; the server goes on serving
        wide = make_adapter(base, tmp_path / "wide", rank=16, seed=9)
        bad = httpx.post(f"{url}/v1/load_lora_adapter", headers=headers, timeout=60,
                         json={"lora_name": "wide", "lora_path": str(wide)})
        assert bad.status_code == 400 and "rank 16" in bad.text and "lora.max_rank" in bad.text
        assert httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": "x", "lora_path": str(wide)}).status_code == 401
        assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=headers, timeout=60,
                          json={"lora_name": "nope"}).status_code == 400
        assert complete("a3", PROMPTS[1]) == lora_expected("a3", PROMPTS[1])
        tokenized = httpx.post(f"{url}/tokenize", headers=headers, timeout=30, json={"model": "a3", "prompt": "hi"})
        assert tokenized.status_code == 200 and tokenized.json()["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parallel.tensor=3", "parallel.pipeline=2"])
def test_sharded_adapters_match_transformers_merged(tmp_path, tiny_checkpoints, lora_adapters, lora_expected, layout):
    """Four adapters and the base in one batch at tp=3 (A and B sharded as the base layers
    are, the row-parallel deltas summed by the all-reduce) and pp=2 (each stage its layers')."""
    settings = [f"model.path={tiny_checkpoints['llama-6h']}", *adapter_settings(lora_adapters), layout]
    env = os.environ | {"OMP_NUM_THREADS": "2"}
    zmq = f"tcp://127.0.0.1:{free_port()}"
    with http_server(tmp_path, *settings, zmq=zmq, env=env):
        requests = [(n, p) for p in PROMPTS for n in [None, *lora_adapters]]
        assert zmq_tokens(zmq, requests) == [lora_expected(n, p) for n, p in requests]


@pytest.mark.slow
def test_replicas_serve_adapters_and_the_front_door_loads_them_on_each(tmp_path, tiny_checkpoints, lora_adapters,
                                                                       lora_expected):
    """parallel.data=2 behind the front door (cache-aware): adapters chosen by `model`, one loaded
    at run time on both replicas, each request given its adapter's tokens wherever it runs."""
    settings = [f"model.path={tiny_checkpoints['llama-6h']}", *adapter_settings(lora_adapters, ["a0", "a1"]),
                "parallel.data=2", "router.policy=cache_aware"]
    with http_server(tmp_path, *settings) as (_, url), openai_client(url, 120) as oai:
        load = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": "a2", "lora_path": str(lora_adapters["a2"])})
        assert load.status_code == 200, load.text
        base_name = oai.models.list().data[0].id
        assert {m.id for m in oai.models.list().data} == {base_name, "a0", "a1", "a2"}

        def complete(model, prompt):
            out = oai.completions.create(model=model or base_name, prompt=prompt, max_tokens=TOKENS, temperature=0.0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
            return out.choices[0].token_ids

        requests = [(n, p) for p in PROMPTS for n in ["a0", "a1", "a2", None]] * 2
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda r: complete(*r), requests))
        assert results == [lora_expected(n, p) for n, p in requests]
        bad = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                         json={"lora_name": "x", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and "adapter_config.json is missing" in bad.text
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'reason="adapter"' in metrics  # a new prompt of an adapter went where the adapter was served
        reset = httpx.post(f"{url}/reset_prefix_cache", timeout=60)  # the front door's reaches both replicas
        assert reset.status_code == 200 and reset.json()["dropped_blocks"] > 0, reset.text
