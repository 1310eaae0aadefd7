"""Context parallelism through the whole engine on gloo ranks: greedy tokens and top-5
logprobs equal the single-rank run at cp = 2 and 4, and composed with TP and PP; long
prompts prefilled in one piece and in chunks over a cached prefix; decode over the
sharded cache."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import SamplingParams
from meshserve.parallel.topology import Topology
from support.dist import run_ranks
from support.engine_ranks import assert_same, run_engine

PROMPTS = [list(range(300, 341)), [1, 504, 3575], list(range(1000, 1100)), [7, 8, 9, 10, 11, 12, 13, 14, 15]]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5) for n in (12, 9, 7, 10)]


def engine_results(topology: Topology, overrides: list[str]):
    results = run_ranks(run_engine, topology, overrides, PROMPTS, PARAMS)
    assert all(r is None for r in results[1:])
    return results[0][0]


def base(path, budget):
    return [f"model.path={path}", "model.max_model_len=256", "cache.memory=8MiB",
            f"scheduler.max_batched_tokens={budget}"]


@pytest.fixture(scope="module")
def single(tiny_checkpoints):
    return engine_results(Topology(), base(tiny_checkpoints["llama"], 2048))


@pytest.mark.parametrize("topology,budget", [
    (Topology(cp_size=2), 2048),           # whole prompts in one step: ring over two ranks
    (Topology(cp_size=2), 24),             # chunked prefill: chunks attend to a prefix spread over the ranks
    (Topology(cp_size=4), 2048),
    (Topology(tp_size=2, cp_size=2), 40),  # tp x cp
    (Topology(pp_size=2, cp_size=2), 2048),  # pp x cp
])
def test_context_parallel_matches_single_rank(tiny_checkpoints, single, topology, budget):
    overrides = [*base(tiny_checkpoints["llama"], budget), f"parallel.context={topology.cp_size}",
                 f"parallel.tensor={topology.tp_size}", f"parallel.pipeline={topology.pp_size}"]
    assert_same(engine_results(topology, overrides), single)


@pytest.mark.slow
def test_tp_pp_cp_2x2x2(tiny_checkpoints, single):
    overrides = [*base(tiny_checkpoints["llama"], 64), "parallel.context=2", "parallel.tensor=2", "parallel.pipeline=2"]
    assert_same(engine_results(Topology(tp_size=2, pp_size=2, cp_size=2), overrides), single)
