"""Sequence parallelism (parallel/sequence.py) on gloo ranks: its reduce-scatter and
all-gather against the sums they stand for, over shared memory and over gloo; and the whole
engine with it against one rank and against tensor parallelism without it (tp = 3, tp x pp
= 2 x 2, a MoE model with a shared expert), its prefill steps split and its decode steps not."""

from __future__ import annotations

import pytest
import torch

from meshserve.comm.messages import SamplingParams
from meshserve.parallel.sequence import SequenceParallel
from meshserve.parallel.topology import Topology
from support.dist import run_ranks
from support.engine_ranks import assert_same, run_engine

SIZES = (9, 10, 13, 4)
"""Steps of tp = 3: counts [3, 3, 3], [4, 4, 2], [5, 5, 3]; 4 tokens do not split (< tp**2)."""


def split_collectives(groups):
    tp, out = groups.tp, []
    for n in SIZES:
        sp = SequenceParallel(tp, min_tokens=1)
        split = sp.plan(n)
        base = torch.arange(n * 5, dtype=torch.float32).view(n, 5)
        mine = sp.reduce(base * (tp.rank + 1))  # the sum over ranks: base * 6
        out.append((split, sp.counts, mine.clone(), sp.gather(mine).clone(), sp.rows(base).clone()))
    return out


@pytest.mark.parametrize("shm_slot_bytes", [4 << 20, 0], ids=["shm", "gloo"])
def test_reduce_scatter_and_all_gather_rows_match_the_sum(shm_slot_bytes):
    results = run_ranks(split_collectives, Topology(tp_size=3), shm_slot_bytes=shm_slot_bytes)
    for rank, per_size in enumerate(results):
        for n, (split, counts, mine, gathered, rows) in zip(SIZES, per_size):
            whole = torch.arange(n * 5, dtype=torch.float32).view(n, 5) * 6
            if not split:
                assert counts is None and torch.equal(mine, whole) and torch.equal(gathered, whole)
                continue
            m = -(-n // 3)
            assert counts == [m, m, n - 2 * m]
            start = m * rank
            assert torch.equal(mine, whole[start:start + counts[rank]])
            assert torch.equal(rows * 6, mine)
            assert torch.equal(gathered, whole)


PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7], list(range(1000, 1023))]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5) for n in (9, 14, 6, 11)]
BASE = ["model.max_model_len=256", "cache.memory=8MiB", "scheduler.max_batched_tokens=32"]
SP = ["parallel.sequence_parallel=true", "parallel.sequence_parallel_min_tokens=9"]


def engine(path, topology: Topology, extra: list[str]):
    overrides = [f"model.path={path}", *BASE, f"parallel.tensor={topology.tp_size}",
                 f"parallel.pipeline={topology.pp_size}", *extra]
    results = run_ranks(run_engine, topology, overrides, PROMPTS, PARAMS)
    assert all(r is None for r in results[1:])
    return results[0]


@pytest.mark.parametrize("kind,tp,pp", [("llama-6h", 3, 1), ("llama", 2, 2), ("qwen2-moe", 2, 1)])
def test_engine_with_sequence_parallelism_matches_one_rank(tiny_checkpoints, kind, tp, pp):
    """Chunked prefill (32-token budget) splits; the decode steps (4 tokens) keep the all-reduce."""
    path = tiny_checkpoints[kind]
    want, _ = engine(path, Topology(), [])
    got, stats = engine(path, Topology(tp_size=tp, pp_size=pp), SP)
    assert 0 < stats["steps_split"] < stats["steps"]
    assert_same(got, want)
    if tp == 3:  # and as tensor parallelism without it
        plain, plain_stats = engine(path, Topology(tp_size=tp), [])
        assert "steps_split" not in plain_stats
        assert_same(got, plain)
