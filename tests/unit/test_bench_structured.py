"""scripts/bench_structured.py's pure helpers, without a server: both arms ask for the same
sampling and neither can stop early, the arms take turns going first, and a run's figures
count the tokens the requests really produced."""

from __future__ import annotations

import pytest

from support.scripts import script_module


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_structured") as module:
        yield module


def test_arms_sample_alike_and_run_to_max_tokens(bench):
    free = bench.request_params("unconstrained", 7, 64)
    bound = bench.request_params("constrained", 7, 64)
    assert free == {"max_tokens": 64, "temperature": 0.7, "seed": 7, "ignore_eos": True}
    assert bound == {"max_tokens": 64, "temperature": 0.7, "seed": 7,
                     "structured_outputs": {"json": bench.LONG_SCHEMA}}
    assert bench.LONG_SCHEMA["properties"]["readings"]["minItems"] >= 1024


def test_arms_take_turns_going_first(bench):
    assert [bench.arm_order(r)[0] for r in range(4)] == ["unconstrained", "constrained"] * 2
    assert sorted(bench.arm_order(1)) == sorted(bench.ARMS)


def test_prompts_differ(bench):
    texts = bench.prompts(12)
    assert len(set(texts)) == 12


def test_run_summary_counts_tokens_and_short_requests(bench):
    results = [{"token_ids": [1] * 4, "ttft_s": 0.1, "tpot_s": 0.02, "finish_reason": "length", "text": "ab"},
               {"token_ids": [1] * 3, "ttft_s": 0.3, "tpot_s": 0.04, "finish_reason": "stop", "text": "c"}]
    r = bench.summarize_run(results, 2.0, 4)
    assert (r["output_tokens"], r["min_tokens"], r["max_tokens"], r["short_requests"]) == (7, 3, 4, 1)
    assert r["tokens_per_s"] == pytest.approx(3.5)
    assert r["ttft_ms_p50"] == pytest.approx(200.0) and r["tpot_ms_p50"] == pytest.approx(30.0)
    assert r["finish_reasons"] == ["length", "stop"]


def test_ratio_pairs_each_repetition(bench):
    constrained = [{"tokens_per_s": 90.0}, {"tokens_per_s": 40.0}, {"tokens_per_s": 95.0}]
    unconstrained = [{"tokens_per_s": 100.0}, {"tokens_per_s": 50.0}, {"tokens_per_s": 100.0}]
    assert bench.paired_ratio(constrained, unconstrained) == pytest.approx(0.9)
