"""Ring attention and the LSE merge against full causal attention, on gloo ranks:
cp = 2 and 4, GQA, uneven lengths, chunks after a cached prefix, several sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshserve.parallel.context import advance, chunk_owners, is_split
from meshserve.parallel.ring_attention import attend, merge_over_cp, ring_attention
from meshserve.parallel.topology import Topology
from support.dist import run_ranks

HEADS, KV_HEADS, DIM = 6, 2, 16
BLOCK = 4
"""KV block size: tokens are striped over the ranks by blocks of this many positions."""


def full_causal(q, k, v):
    """Reference: (L, H, D) queries over (L, Hkv, D) keys of the same sequence, causal."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                       enable_gqa=True)
    return o.transpose(0, 1)


def check_ring(groups, chunks, seed):
    """One sequence computed in `chunks` (lengths); every chunk's queries on their owners
    attend, by ring, to the keys each rank stores. Returns the max error vs full attention."""
    cp = groups.cp
    g = torch.Generator().manual_seed(seed)
    total = sum(chunks)
    q, k, v = (torch.randn(total, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    want = full_causal(q, k, v)
    lens = [0] * cp.size
    owners_all: list[int] = []
    start, worst = 0, 0.0
    for n in chunks:
        owners = chunk_owners(start, n, cp.size, BLOCK)
        lens = advance(lens, owners)
        owners_all += owners
        held = [p for p, o in enumerate(owners_all) if o == cp.rank]  # this rank's keys, prefix included
        if is_split(owners, cp.size):  # the chunk's queries live on their owners: ring
            mine = [start + i for i, o in enumerate(owners) if o == cp.rank]
            out, lse = ring_attention(q[mine], mine, k[held], v[held], held, lens, cp, DIM ** -0.5)
        else:  # a short chunk is computed on every rank: partial attention, merged
            mine = list(range(start, start + n))
            out, lse = attend(q[mine], mine, k[held], v[held], held, DIM ** -0.5)
            out = merge_over_cp(out, lse, cp)
        worst = max(worst, (out - want[mine]).abs().max().item())
        start += n
    return worst


def check_decode_merge(groups, prompt, seed):
    """Replicated queries (every rank has them), keys split by owner: partial attention on
    each rank, merged over the group."""
    cp = groups.cp
    g = torch.Generator().manual_seed(seed)
    total = prompt + 3
    q, k, v = (torch.randn(total, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    want = full_causal(q, k, v)
    owners = chunk_owners(0, total, cp.size, BLOCK)  # the prompt, then three decode steps
    lens = advance([0] * cp.size, owners)
    held = [p for p, o in enumerate(owners) if o == cp.rank]
    queries = list(range(prompt, total))
    out, lse = attend(q[queries], queries, k[held], v[held], held, DIM ** -0.5)
    merged = merge_over_cp(out, lse, cp)
    return (merged - want[queries]).abs().max().item(), lens


def run_checks(groups):
    errors = [check_ring(groups, chunks, seed) for seed, chunks in enumerate(
        [[37], [64, 29], [9, 100], [1000], [5, 3, 40]])]  # uneven, a cached prefix, a tiny first chunk
    decode = [check_decode_merge(groups, prompt, 10 + prompt) for prompt in (3, 17, 64)]
    return errors, decode


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_causal(cp):
    results = run_ranks(run_checks, Topology(cp_size=cp))
    for errors, decode in results:
        assert max(errors) < 1e-5, errors
        assert max(e for e, _ in decode) < 1e-5, decode
    lens = results[0][1][1][1]  # shards stay balanced: 17 + 3 tokens over cp ranks, a block apart at most
    assert max(lens) - min(lens) <= BLOCK


def test_attend_single_rank_with_gaps():
    """Keys and queries with gaps in their positions (a rank's share of striped blocks)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(40, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    want = full_causal(q, k, v)
    keys = list(range(0, 10)) + list(range(25, 40))
    queries = list(range(5, 12)) + list(range(30, 40))
    out, lse = attend(q[queries], queries, k[keys], v[keys], keys, DIM ** -0.5)
    # the reference restricted to those keys
    mask = torch.tensor(queries)[:, None] >= torch.tensor(keys)[None, :]
    ref = F.scaled_dot_product_attention(q[queries].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1),
                                         attn_mask=mask, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert want.shape == (40, HEADS, DIM)
