"""The torch and cpu backends' paged attention against dense causal attention over the
whole sequence: prefill chunks of several query blocks, with and without a cached prefix,
next to a decoding sequence in the same step (its decode by gather + SDPA, or by the C++
kernel)."""

from __future__ import annotations

import pytest
import torch

from meshserve.layers.attention import QUERY_BLOCK, AttentionMetadata
from meshserve.layers.backend import TorchBackend, select_backend
from meshserve.layers.kernels import cpu_library

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 8


def dense_causal(q, k, v, scale):
    """(len, heads, dim) float64 softmax attention, causal, GQA by repeating KV heads."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(torch.ones(len(q), len(k), dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("cpu_kernels", [False, pytest.param(True, marks=pytest.mark.skipif(
    cpu_library.load() is None, reason="no C++ compiler for the cpu backend's kernel"))])
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

    backend = select_backend("cpu", library=cpu_library.load()) if cpu_kernels else TorchBackend()
    meta = backend.build_metadata([first, other], [first, other], [table_a, table_b], BLOCK)
    assert len(meta.prefills[0].query_blocks) == 3
    out1 = backend.attention(torch.cat([qa[:first], qb[:other]]), torch.cat([ka[:first], kb[:other]]),
                             torch.cat([va[:first], vb[:other]]), cache, meta, scale)
    meta = backend.build_metadata([second, 1], [total_a, total_b], [table_a, table_b], BLOCK)
    assert isinstance(meta, AttentionMetadata) != cpu_kernels  # each backend reads its own metadata type
    assert [b.mask is not None for b in meta.prefills[0].query_blocks] == [True, True]
    out2 = backend.attention(torch.cat([qa[first:], qb[other:]]), torch.cat([ka[first:], kb[other:]]),
                             torch.cat([va[first:], vb[other:]]), cache, meta, scale)

    want_a, want_b = dense_causal(qa, ka, va, scale), dense_causal(qb, kb, vb, scale)
    torch.testing.assert_close(out1[:first].double(), want_a[:first], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out1[first:].double(), want_b[:other], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2[:second].double(), want_a[first:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2[second:].double(), want_b[other:], atol=1e-5, rtol=1e-5)


def _no_native_kernels(*args, **kwargs):
    """Stands in for the C++ library's loaders: the torch backend loading a build fails."""
    raise AssertionError("the torch backend loaded the C++ kernels")


@pytest.mark.parametrize("int8", [False, True])
def test_the_torch_backend_is_pure_torch(monkeypatch, int8):
    """A mixed step (a fresh prefill, a chunk after its cached prefix, a decode) and the
    norms, activation and rotary through TorchBackend with the C++ library taken away:
    the reference the other backends are tested against computes everything in torch,
    whatever the machine builds."""
    from meshserve.layers import kv_quant
    from meshserve.layers.rotary import RotaryEmbedding

    monkeypatch.setattr(cpu_library, "load", _no_native_kernels)
    monkeypatch.setattr(cpu_library, "library", _no_native_kernels)
    torch.manual_seed(1)
    backend = TorchBackend()
    assert backend.library is None  # it holds no build of the C++ kernels to call
    row = kv_quant.row_length(HEAD_DIM) if int8 else HEAD_DIM
    cache = tuple(torch.zeros(16, BLOCK, KV_HEADS, row, dtype=torch.int8 if int8 else torch.float32)
                  for _ in range(2))
    tables = [[0, 1, 2], [3, 4], [5, 6]]
    for query_lens, seq_lens in (([20, 9], [20, 9]), ([3, 1, 12], [23, 10, 12])):
        n = sum(query_lens)
        q, k, v = (torch.randn(n, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
        meta = backend.build_metadata(query_lens, seq_lens, tables[:len(query_lens)], BLOCK)
        out = backend.attention(q, k, v, cache, meta, HEAD_DIM ** -0.5)
        assert out.shape == q.shape and torch.isfinite(out).all()
    x, weight = torch.randn(n, 32), torch.rand(32)
    normed, total = backend.rms_norm(x, weight, 1e-5, x)
    torch.testing.assert_close(total, 2 * x)
    assert backend.silu_and_mul(torch.randn(n, 64)).shape == (n, 32)
    rope = RotaryEmbedding(HEAD_DIM, 64, 10000.0).lookup(torch.arange(n), torch.float32)
    assert backend.rotary(rope, q, k)[0].shape == q.shape
