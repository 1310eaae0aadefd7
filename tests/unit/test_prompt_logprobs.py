"""Prompt logprobs (vLLM's prompt_logprobs) through the whole engine equal transformers'
log-softmax over the prompt: across chunked prefill, with a prefix another request cached
(which a request asking for them does not use), and beside requests that did not ask."""

from __future__ import annotations

import pytest
import torch

from meshserve.comm.messages import SamplingParams
from meshserve.engine.offline import generate
from support.engines import make_engine
from support.reference import hf_logits, hf_model

PROMPTS = [list(range(300, 341)), [5, 6, 7, 8], list(range(1000, 1070))]
TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = hf_model(checkpoint)
    return [torch.log_softmax(hf_logits(model, p), dim=-1) for p in PROMPTS]


def check(result, prompt, want, top):
    got = result.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        lp, row = got[pos], want[pos - 1]
        assert lp.token_id == prompt[pos]
        assert lp.logprob == pytest.approx(float(row[prompt[pos]]), abs=2e-3)
        mine = row[prompt[pos]]  # a rank within the tokens as likely as it up to rounding
        assert int((row > mine + 2e-3).sum()) + 1 <= lp.rank <= int((row > mine - 2e-3).sum()) + 1
        values, ids = row.topk(top)
        assert [t for t, _ in lp.top] == ids.tolist() or top == 0
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=2e-3)


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_match_transformers(checkpoint, reference, chunk):
    engine = make_engine(checkpoint, f"scheduler.max_batched_tokens={chunk}")
    params = [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP), SamplingParams(max_tokens=2),
              SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)]
    results = generate(engine, PROMPTS, params)
    check(results[0], PROMPTS[0], reference[0], TOP)
    assert results[1].prompt_logprobs is None
    check(results[2], PROMPTS[2], reference[2], 0)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(checkpoint, reference):
    engine = make_engine(checkpoint)
    generate(engine, [PROMPTS[2]], SamplingParams(max_tokens=1))  # caches its blocks
    again = generate(engine, [PROMPTS[2]], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert again.usage.cached_tokens == 0
    check(again, PROMPTS[2], reference[2], 1)
    plain = generate(engine, [PROMPTS[2]], SamplingParams(max_tokens=1))[0]
    assert plain.usage.cached_tokens > 0


def test_a_one_token_prompt_has_one_none(checkpoint):
    engine = make_engine(checkpoint)
    result = generate(engine, [[42]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert result.prompt_logprobs == [None]
