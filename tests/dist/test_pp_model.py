"""Pipeline parallelism (alone and with TP) through the whole engine on gloo ranks:
greedy tokens and top-5 logprobs equal the single-rank run, for even and uneven splits,
tied and untied embeddings, chunked prefill, preemption and many mixed requests."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import SamplingParams
from meshserve.parallel.topology import Topology
from support.dist import run_ranks
from support.engine_ranks import run_engine

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7], list(range(1000, 1023))]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5) for n in (9, 14, 6, 11)]
BASE = ["model.max_model_len=256", "cache.memory=8MiB"]


def engine_results(topology: Topology, overrides: list[str], prompts=PROMPTS, params=PARAMS):
    results = run_ranks(run_engine, topology, overrides, prompts, params)
    assert all(r is None for r in results[1:])
    return results[0]


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"]
        assert g["finish_reason"] == w["finish_reason"]
        for (gt, glp, gtop), (wt, wlp, wtop) in zip(g["logprobs"], w["logprobs"]):
            assert gt == wt and abs(glp - wlp) < 1e-4
            assert [t for t, _ in gtop] == [t for t, _ in wtop]
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(gtop, wtop))


@pytest.fixture(scope="module")
def single(tiny_checkpoints):
    return {kind: engine_results(Topology(), [f"model.path={tiny_checkpoints[kind]}", *BASE])[0]
            for kind in ("llama", "llama-untied")}


@pytest.mark.parametrize("kind,pp,tp,extra", [
    ("llama", 2, 1, []),                                   # even split (2 + 1 layers), tied embeddings
    ("llama-untied", 2, 1, ["parallel.pipeline_layers=[1, 2]"]),  # uneven split, untied
    ("llama", 3, 1, ["parallel.micro_batches=1"]),          # one layer per stage, no micro-batching
    ("llama", 2, 2, []),                                    # tp x pp = 2 x 2
])
def test_pipeline_matches_single_rank(tiny_checkpoints, single, kind, pp, tp, extra):
    overrides = [f"model.path={tiny_checkpoints[kind]}", *BASE, f"parallel.pipeline={pp}", f"parallel.tensor={tp}",
                 *extra]
    got, _ = engine_results(Topology(tp_size=tp, pp_size=pp), overrides)
    assert_same(got, single[kind])


def test_many_mixed_requests_through_pp2(tiny_checkpoints):
    """Chunked prefill (16-token budget), preemption (few blocks), requests finishing in
    different micro-batches: every one ends with the single-rank result."""
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 3 + (i * 5) % 37)) for i in range(12)]
    params = [SamplingParams(max_tokens=4 + (i * 3) % 13, temperature=0, ignore_eos=True) for i in range(12)]
    overrides = [f"model.path={tiny_checkpoints['llama']}", "model.max_model_len=128", "cache.block_size=4",
                 "cache.num_blocks=40", "scheduler.max_batched_tokens=16"]
    want, _ = engine_results(Topology(), overrides, prompts, params)
    got, stats = engine_results(Topology(pp_size=2), [*overrides, "parallel.pipeline=2"], prompts, params)
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
    assert all(len(g["token_ids"]) == p.max_tokens for g, p in zip(got, params))
    assert stats["preemptions"] > 0
