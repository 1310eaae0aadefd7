"""The torch and cpu backends' paged attention against dense causal attention over the
whole sequence: prefill chunks of several query blocks, with and without a cached prefix,
next to a decoding sequence in the same step (its decode by gather + SDPA, or by the C++
kernel)."""

from __future__ import annotations

import pytest
import torch

from meshserve.layers.attention import QUERY_BLOCK, build_attention_metadata, paged_attention
from meshserve.layers.kernels import cpu_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 8


def dense_causal(q, k, v, scale):
    """(len, heads, dim) float64 softmax attention, causal, GQA by repeating KV heads."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(torch.ones(len(q), len(k), dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("cpu_kernels", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_attention.available(), reason="no C++ compiler for the cpu backend's kernel"))])
def test_chunks_of_several_query_blocks_match_dense_attention(cpu_kernels):
    torch.manual_seed(0)
    first, second = 2 * QUERY_BLOCK + 5, QUERY_BLOCK + 20  # sequence A: prefill, then a chunk after its prefix
    other = 30  # sequence B: prefilled in step 1, decodes one token in step 2
    total_a, total_b = first + second, other + 1
    qa, ka, va = (torch.randn(total_a, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    qb, kb, vb = (torch.randn(total_b, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    cache = tuple(torch.zeros(64, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(2))
    table_a, table_b = list(range(1, 1 + -(-total_a // BLOCK))), list(range(40, 40 + -(-total_b // BLOCK)))
    scale = HEAD_DIM ** -0.5

    meta = build_attention_metadata([first, other], [first, other], [table_a, table_b], BLOCK)
    assert len(meta.prefills[0].query_blocks) == 3
    out1 = paged_attention(torch.cat([qa[:first], qb[:other]]), torch.cat([ka[:first], kb[:other]]),
                           torch.cat([va[:first], vb[:other]]), cache, meta, scale)
    meta = build_attention_metadata([second, 1], [total_a, total_b], [table_a, table_b], BLOCK,
                                    cpu_kernels=cpu_kernels)
    assert (meta.decode_lens is not None) == cpu_kernels and (meta.decode_mask is None) == cpu_kernels
    assert [b.mask is not None for b in meta.prefills[0].query_blocks] == [True, True]
    out2 = paged_attention(torch.cat([qa[first:], qb[other:]]), torch.cat([ka[first:], kb[other:]]),
                           torch.cat([va[first:], vb[other:]]), cache, meta, scale)

    want_a, want_b = dense_causal(qa, ka, va, scale), dense_causal(qb, kb, vb, scale)
    torch.testing.assert_close(out1[:first].double(), want_a[:first], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out1[first:].double(), want_b[:other], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2[:second].double(), want_a[first:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2[second:].double(), want_b[other:], atol=1e-5, rtol=1e-5)
