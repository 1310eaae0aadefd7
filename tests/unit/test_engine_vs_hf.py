"""Greedy generations through the whole engine equal transformers', also when requests
arrive at different steps and share batches, with chunked prefill, and after preemption."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import SamplingParams
from meshserve.engine.offline import generate
from support.engines import make_engine
from support.reference import hf_greedy, hf_model


PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7], list(range(1000, 1023)),
           [9, 99, 999, 9999, 19999], list(range(2000, 2064))]
NEW_TOKENS = [12, 20, 7, 16, 25, 10]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    model = hf_model(tiny_checkpoints["llama"])
    return [hf_greedy(model, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]


def run_staggered(engine, arrivals):
    """Add request i at step arrivals[i]; step until all finish. Returns token ids per request."""
    results = {i: [] for i in range(len(PROMPTS))}
    finished = set()
    step = 0
    while len(finished) < len(PROMPTS):
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(i, str(i), PROMPTS[i],
                                   SamplingParams(max_tokens=NEW_TOKENS[i], temperature=0, ignore_eos=True))
        for i, delta in engine.step():
            results[i] += delta.token_ids
            if delta.finish_reason:
                assert delta.finish_reason == "length"
                finished.add(i)
        step += 1
        assert step < 500
    return [results[i] for i in range(len(PROMPTS))]


def test_batch_at_once_matches_transformers(tiny_checkpoints, reference):
    engine = make_engine(tiny_checkpoints["llama"])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in NEW_TOKENS]
    got = [c.token_ids for c in generate(engine, PROMPTS, params)]
    assert got == reference


def test_staggered_arrivals_with_chunked_prefill(tiny_checkpoints, reference):
    # 16-token budget: long prompts are prefilled in chunks while others decode.
    engine = make_engine(tiny_checkpoints["llama"], "scheduler.max_batched_tokens=16", "cache.block_size=4")
    assert run_staggered(engine, arrivals=[0, 1, 3, 4, 9, 10]) == reference


def test_preemption_keeps_results(tiny_checkpoints, reference):
    # 24 blocks of 4 tokens cannot hold every sequence at once: the scheduler must preempt.
    engine = make_engine(tiny_checkpoints["llama"], "cache.block_size=4", "cache.num_blocks=24",
                         "model.max_model_len=96")
    assert run_staggered(engine, arrivals=[0, 0, 0, 0, 0, 0]) == reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.blocks.num_free == 24


def test_max_num_seqs_queues_the_rest(tiny_checkpoints, reference):
    engine = make_engine(tiny_checkpoints["llama"], "scheduler.max_num_seqs=2")
    assert run_staggered(engine, arrivals=[0] * 6) == reference


def test_smollm2_greedy_matches_transformers(smollm2_reference):
    engine = make_engine("builtin:smollm2-135m-instruct", "cache.memory=64MiB")
    tok = engine.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    want = [hf_greedy(smollm2_reference, p, 24) for p in prompts]
    got = generate(engine, prompts, SamplingParams(max_tokens=24, temperature=0))
    for w, g in zip(want, got):
        eos = w.index(2) + 1 if 2 in w else len(w)
        assert g.token_ids == w[:eos]
        assert g.finish_reason == ("stop" if eos < len(w) or w[-1] == 2 else "length")
        assert g.text == tok.decode(w[:eos])


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe", "mixtral", "qwen2-moe"])
def test_each_family_greedy_matches_transformers(tiny_checkpoints, kind):
    """Six prompts batched (a MoE step routes every sequence's tokens together), one
    staggered with chunked prefill: transformers' greedy tokens, one prompt at a time."""
    model = hf_model(tiny_checkpoints[kind])
    want = [hf_greedy(model, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
    engine = make_engine(tiny_checkpoints[kind])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in NEW_TOKENS]
    assert [c.token_ids for c in generate(engine, PROMPTS, params)] == want
    engine = make_engine(tiny_checkpoints[kind], "scheduler.max_batched_tokens=16", "cache.block_size=4")
    assert run_staggered(engine, arrivals=[0, 1, 3, 4, 9, 10]) == want
