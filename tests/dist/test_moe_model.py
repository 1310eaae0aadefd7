"""Expert parallelism on gloo ranks: the MoE block at ep=2 x tp=2 against the per-token
float64 loop (tokens dispatched all-to-all, a step with fewer tokens than ranks), and the
whole engine at ep=2 x pp=2, ep=2 x tp=2 and ep=2 against one rank (greedy tokens and top-5
logprobs), for each MoE family."""

from __future__ import annotations

import pytest
import torch

from meshserve.comm.messages import SamplingParams
from meshserve.parallel.topology import Topology
from support import moe as layer
from support.dist import run_ranks
from support.engine_ranks import assert_same, run_engine

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7]]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5) for n in (9, 14, 6)]
BASE = ["model.max_model_len=256", "cache.memory=8MiB"]


EXCHANGES = ("all_to_all", "all_reduce")


def block_on_ranks(groups, token_counts):
    w = layer.weights(seed=11)
    results = {}
    for exchange in EXCHANGES:
        moe = layer.build(w, top_k=2, tp=groups.tp, ep=groups.ep, exchange=exchange)
        outs = []
        for n in token_counts:
            x = torch.randn(n, layer.H, generator=torch.Generator().manual_seed(n))
            outs.append(moe(x))
        results[exchange] = (outs, moe.tokens_computed)
    return results, groups.ep.timer.calls


def test_block_over_ep2_tp2_matches_the_per_token_loop():
    counts = [1, 7, 33]  # 1: one ep rank's slice of the tokens is empty
    results = run_ranks(block_on_ranks, Topology(tp_size=2, ep_size=2), counts)
    w = layer.weights(seed=11)
    for i, n in enumerate(counts):
        x = torch.randn(n, layer.H, generator=torch.Generator().manual_seed(n))
        want, _ = layer.reference(x, w, 2, True)
        for by_exchange, _ in results:  # every rank ends with every token's output
            for exchange in EXCHANGES:
                layer.assert_close(by_exchange[exchange][0][i], want, 1e-5)
    for exchange in EXCHANGES:
        # Each ep rank computes its experts' pairs, once per tp rank: all pairs, twice in all.
        assert sum(r[0][exchange][1] for r in results) == 2 * 2 * sum(counts)
    assert all(r[1] > 0 for r in results), "no collective ran over the expert group"


@pytest.fixture(scope="module")
def single(tiny_checkpoints):
    return {kind: run_ranks(run_engine, Topology(), [f"model.path={tiny_checkpoints[kind]}", *BASE], PROMPTS,
                            PARAMS)[0][0] for kind in ("qwen3-moe", "mixtral", "qwen2-moe")}


@pytest.mark.parametrize("kind,topology,extra", [
    ("qwen3-moe", Topology(pp_size=2, ep_size=2), ["parallel.pipeline=2"]),
    ("mixtral", Topology(tp_size=2, ep_size=2), ["parallel.tensor=2"]),
    ("qwen2-moe", Topology(ep_size=2), []),
    ("qwen3-moe", Topology(tp_size=2, ep_size=2), ["parallel.tensor=2", "parallel.expert_exchange=all_reduce"]),
])
def test_expert_parallel_engine_matches_one_rank(tiny_checkpoints, single, kind, topology, extra):
    overrides = [f"model.path={tiny_checkpoints[kind]}", *BASE, f"parallel.expert={topology.ep_size}", *extra]
    results = run_ranks(run_engine, topology, overrides, PROMPTS, PARAMS)
    assert all(r is None for r in results[1:])
    assert_same(results[0][0], single[kind])
