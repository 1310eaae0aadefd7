"""A mixture-of-experts model served for real: `meshserve serve` starting a Qwen3-MoE
checkpoint at parallel.expert=2 (two ranks, the experts split), chat through the real
openai client equal to transformers' greedy text, and /metrics showing each rank's share of
the expert load and its exchange time."""

from __future__ import annotations

import time

import httpx
import openai

from support.checkpoints import smollm2_tokenizer
from support.deployments import chat_ids, samples, serve
from support.reference import hf_greedy, hf_model

QUESTIONS = ["What is the capital of France?", "Name a primary color."]


def test_a_moe_model_at_ep2_serves_transformers_text(tmp_path, tiny_checkpoints):
    path = tiny_checkpoints["qwen3-moe"]
    tok = smollm2_tokenizer()  # the tiny checkpoints carry SmolLM2's tokenizer and chat template
    ref = hf_model(path)
    server, _, url = serve(tmp_path, "moe-ep2", f"model.path={path}", "parallel.expert=2", "cache.memory=16MiB")
    try:
        log = server.tail(1 << 20)
        assert "world_size=2" in server.wait_ready(), log[-3000:]
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        model = api.models.list().data[0].id
        for q in QUESTIONS:
            messages = [{"role": "user", "content": q}]
            got = api.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
            want = hf_greedy(ref, chat_ids(tok, messages), 12)
            cut = want.index(2) if 2 in want else len(want)
            assert got.choices[0].message.content == tok.decode(want[:cut], skip_special_tokens=True), q
        deadline = time.monotonic() + 30
        while True:  # the follower's counters reach the driver about once a second
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            load = samples(metrics, "meshserve_expert_tokens")
            if len(load) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert set(load) == {('rank="0"',), ('rank="1"',)} and all(v > 0 for v in load.values()), load
        exchange = samples(metrics, "meshserve_expert_comm_seconds")
        assert all(v > 0 for v in exchange.values()), exchange
        assert server.stop() == 0, server.tail()
        assert not server.group_alive()
    finally:
        server.kill()
