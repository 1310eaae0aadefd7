"""Rotary position embedding applied in place to q and k (half-split layout, as Hugging
Face Llama): for each head, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), computed in
float32 and rounded once.

One program per token rotates every query and key head of that token; q and k may be
strided views (the slices of one fused QKV projection). `rotary_store_` also stores the
step's keys and values in the paged KV cache: one kernel where rotary and the two cache
writes were three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshserve.layers.kernels import next_power_of_2


@triton.jit
def _cos_sin(COS, SIN, row, stride_ct, stride_st, offs_d, HALF: tl.constexpr):
    """A token's cos and sin, (1, BLOCK_HALF) float32: they repeat over the two halves, so
    the first half holds every frequency."""
    d_mask = offs_d < HALF
    c = tl.load(COS + row * stride_ct + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(SIN + row * stride_st + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return c, s


@triton.jit
def _load_rotated(base, mask, c, s, HALF: tl.constexpr):
    """The heads at `base` rotated, each half rounded once to the input's dtype."""
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * c - b * s).to(x1.dtype), (b * c + a * s).to(x1.dtype)


@triton.jit
def _rotate(X, row, stride_t, stride_h, n_heads, c, s, offs_h, offs_d, HALF: tl.constexpr):
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HALF)
    base = X + row * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    y1, y2 = _load_rotated(base, mask, c, s, HALF)
    tl.store(base, y1, mask=mask)
    tl.store(base + HALF, y2, mask=mask)


@triton.jit
def _rotary_kernel(Q, K, COS, SIN, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                   n_q_heads, n_k_heads, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    c, s = _cos_sin(COS, SIN, row, stride_ct, stride_st, offs_d, HALF)
    _rotate(Q, row, stride_qt, stride_qh, n_q_heads, c, s, tl.arange(0, BLOCK_QH), offs_d, HALF)
    _rotate(K, row, stride_kt, stride_kh, n_k_heads, c, s, tl.arange(0, BLOCK_KH), offs_d, HALF)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q (num_tokens, num_heads, head_dim) and k (num_tokens, num_kv_heads,
    head_dim) in place; cos, sin: (num_tokens, 1, head_dim) or (num_tokens, head_dim), as
    RotaryEmbedding.lookup returns them. Returns (q, k)."""
    head_dim = q.shape[-1]
    if head_dim % 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary_ needs an even head_dim and a contiguous last dimension")
    n = q.shape[0]
    if n:
        half = head_dim // 2
        _rotary_kernel[(n,)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
                             sin.stride(0), q.shape[1], k.shape[1], HALF=half, BLOCK_HALF=next_power_of_2(half),
                             BLOCK_QH=next_power_of_2(q.shape[1]), BLOCK_KH=next_power_of_2(k.shape[1]))
    return q, k


@triton.jit
def _store_rotated(K, V, KC, VC, row, slot, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                   n_heads, c, s, offs_h, offs_d, HALF: tl.constexpr):
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HALF)
    y1, y2 = _load_rotated(K + row * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask, c, s, HALF)
    cache = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(KC + cache, y1, mask=mask)
    tl.store(KC + cache + HALF, y2, mask=mask)
    v = V + row * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    tl.store(VC + cache, tl.load(v, mask=mask, other=0.0), mask=mask)
    tl.store(VC + cache + HALF, tl.load(v + HALF, mask=mask, other=0.0), mask=mask)


@triton.jit
def _rotary_store_kernel(Q, K, V, KC, VC, COS, SIN, SLOTS, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                         stride_vh, stride_ct, stride_st, stride_cs, stride_ch, n_q_heads, n_k_heads,
                         HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_QH: tl.constexpr,
                         BLOCK_KH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    c, s = _cos_sin(COS, SIN, row, stride_ct, stride_st, offs_d, HALF)
    _rotate(Q, row, stride_qt, stride_qh, n_q_heads, c, s, tl.arange(0, BLOCK_QH), offs_d, HALF)
    slot = tl.load(SLOTS + row).to(tl.int64)
    _store_rotated(K, V, KC, VC, row, slot, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                   n_k_heads, c, s, tl.arange(0, BLOCK_KH), offs_d, HALF)


def rotary_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotates q in place (as rotary_), and stores the rotated k and v at the cache slots
    `slot_mapping` (num_tokens,): k_cache, v_cache (num_blocks, block_size, num_kv_heads,
    head_dim), slot = block * block_size + offset. k itself is left as it was. Returns q."""
    head_dim = q.shape[-1]
    if head_dim % 2 or any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, k_cache, v_cache)):
        raise ValueError("rotary_store_ needs an even head_dim and a contiguous last dimension")
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype or k_cache.stride() != v_cache.stride():
        raise ValueError("rotary_store_ needs k, v and caches of one dtype, and caches of one layout")
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("rotary_store_ needs a cache whose slots are evenly strided")
    n = q.shape[0]
    if n:
        half = head_dim // 2
        _rotary_store_kernel[(n,)](q, k, v, k_cache, v_cache, cos, sin, slot_mapping, q.stride(0), q.stride(1),
                                   k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
                                   k_cache.stride(1), k_cache.stride(2), q.shape[1], k.shape[1], HALF=half,
                                   BLOCK_HALF=next_power_of_2(half), BLOCK_QH=next_power_of_2(q.shape[1]),
                                   BLOCK_KH=next_power_of_2(k.shape[1]))
    return q
