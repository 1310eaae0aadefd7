"""Prefix caching across ranks: a second wave of prompts that share prefixes with the first
(a prefix ending mid-block, a fully cached prompt, multi-turn history) reuses the first
wave's KV blocks at cp = 2, pp = 2 and tp = 2, with the greedy tokens and top-5 logprobs of
one rank without a prefix cache, and `cached_tokens` exactly what the layout allows: whole
block-table entries (block_size x cp tokens), short of the prompt's last token."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import SamplingParams
from meshserve.parallel.topology import Topology
from support.dist import run_ranks
from support.engine_ranks import assert_same, run_engine

FIRST = [list(range(300, 341)), list(range(1000, 1100))]
FIRST_TOKENS = [12, 7]
SECOND = [
    FIRST[0] + [5, 6, 7],           # a prefix of 41 tokens: blocks of 4 end at 40, one token into the next
    FIRST[1][:70] + [1, 2, 3],      # a prefix ending mid-block
    FIRST[1],                       # the whole prompt again: its last token is computed anyway
    list(range(2000, 2030)),        # nothing shared
]
BLOCK = 4


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5)


def results(topology: Topology, path, caching: bool, second):
    overrides = [f"model.path={path}", "model.max_model_len=256", "cache.memory=8MiB", f"cache.block_size={BLOCK}",
                 f"cache.prefix_caching={str(caching).lower()}", "scheduler.max_batched_tokens=64",
                 f"parallel.context={topology.cp_size}", f"parallel.tensor={topology.tp_size}",
                 f"parallel.pipeline={topology.pp_size}"]
    out = run_ranks(run_engine, topology, overrides, FIRST, [params(n) for n in FIRST_TOKENS],
                    (second, [params(6)] * len(second)))
    return out[0][0]


def second_wave(first_results) -> list[list[int]]:
    """SECOND plus a multi-turn follow-up: the first prompt, its answer, and a new turn."""
    return SECOND + [FIRST[0] + first_results[0]["token_ids"] + [9, 10, 11]]


def want_cached(cp: int) -> list[int]:
    unit = BLOCK * cp
    # computed tokens of the first wave: prompt + output - 1 (the last sampled token is not)
    computed = [len(p) + n - 1 for p, n in zip(FIRST, FIRST_TOKENS)]
    shared = [41, 70, 100, 0, len(FIRST[0]) + FIRST_TOKENS[0]]
    owners = [0, 1, 1, None, 0]
    lengths = [44, 73, 100, 30, len(FIRST[0]) + FIRST_TOKENS[0] + 3]
    out = []
    for length, same, owner in zip(lengths, shared, owners):
        if owner is None:
            out.append(0)
            continue
        units = min(same // unit, computed[owner] // unit, (length - 1) // unit)
        out.append(units * unit)
    return out


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    """One rank, no prefix cache: the first wave, then the second."""
    path = tiny_checkpoints["llama"]
    first = results(Topology(), path, False, SECOND[:1])[:2]
    second = second_wave(first)
    return second, results(Topology(), path, False, second)


@pytest.mark.parametrize("topology", [Topology(), Topology(cp_size=2), Topology(pp_size=2), Topology(tp_size=2)],
                         ids=["one-rank", "cp2", "pp2", "tp2"])
def test_prefix_cache_across_ranks_matches_one_rank_without_it(tiny_checkpoints, reference, topology):
    second, want = reference
    got = results(topology, tiny_checkpoints["llama"], True, second)
    assert_same(got, want)
    assert all(r["cached_tokens"] == 0 for r in want)
    assert [r["cached_tokens"] for r in got[:2]] == [0, 0]
    assert [r["cached_tokens"] for r in got[2:]] == want_cached(topology.cp_size)
