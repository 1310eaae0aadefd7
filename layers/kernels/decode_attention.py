"""Paged decode attention: one new query per sequence over its cached keys and values, with
GQA and any context length, returning the output and the log-sum-exp (LSE).

Grid (sequences, KV heads, splits). A program takes all the query heads of one KV head as
the rows of its tile (padded to 16 for tl.dot), so each cached key is read once per group,
and walks one slice of the context in tiles of BLOCK_N tokens, finding each token's slot
through the block table (any cache block size). With few sequences and long contexts the
context is split into slices (flash-decoding) so the GPU fills up; `_merge_kernel` then
combines the slices exactly by their LSEs.

LSE contract (as the context-parallel merge expects): natural log of the sum of exp of the
scaled scores, float32, (num_queries, num_heads); a sequence with no cached token gives
out 0 and LSE -inf.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from meshserve.layers.kernels import next_power_of_2

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # a kernel may read a global only if it is a constexpr
MIN_TILES_PER_SPLIT = 4
"""A context slice spans at least this many BLOCK_N tiles, so a split pays for its merge."""


@triton.jit(do_not_specialize=["stride_tab"])  # it varies with the batch: one compiled variant
def _decode_kernel(Q, K, V, O, LSE, ROWS, TABLES, LENS, SKIPS,
                   stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ls, stride_tab,
                   scale_log2, split_len,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_SKIP: tl.constexpr,
                   PARTIAL: tl.constexpr, STORE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_ROWS:
        row = tl.load(ROWS + seq)
    else:
        row = seq
    length = tl.load(LENS + seq)
    if HAS_SKIP:
        skip = tl.load(SKIPS + seq)
    lo = split * split_len
    hi = tl.minimum(length, lo + split_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_H, BLOCK_D)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 units
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = TABLES + seq * stride_tab
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(K + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if HAS_SKIP:  # a draft tree's row: not the keys of the branches beside its path
            back = length - 1 - pos
            bit = (skip >> tl.minimum(tl.maximum(back, 0), 63)) & 1
            valid = valid & ((back >= 64) | (bit == 0))
        s = tl.where(valid[None, :], s, float("-inf"))
        # every tile holds a valid token (a row's own key is never skipped, and skipped keys
        # are within the last 64 of a tile or slice at least that long), so m_new is finite
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.maximum(l, 1e-30)[:, None]  # an empty slice: l = 0, out 0
    lse = tl.where(l > 0, (m + tl.log2(tl.maximum(l, 1e-30))) * LN2, float("-inf"))
    if PARTIAL:
        row = seq
    o_ptr = O + row * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    if STORE_LSE:
        tl.store(LSE + seq * stride_lt + heads * stride_lh + split * stride_ls, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits"])  # it varies with the batch: one compiled variant
def _merge_kernel(PO, PL, O, LSE, ROWS, num_splits,
                  stride_pt, stride_ph, stride_ps, stride_plt, stride_plh, stride_ot, stride_oh, stride_lt, stride_lh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_ROWS: tl.constexpr,
                  STORE_LSE: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(ROWS + seq)
    else:
        row = seq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(PL + seq * stride_plt + head * stride_plh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for empty slices
    total = tl.sum(w, 0)
    part = tl.load(PO + seq * stride_pt + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.maximum(total, 1e-30)
    tl.store(O + row * stride_ot + head * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_mask)
    if STORE_LSE:
        tl.store(LSE + seq * stride_lt + head * stride_lh,
                 tl.where(total > 0, m_safe + tl.log(tl.maximum(total, 1e-30)), float("-inf")))


def block_n_for(device: torch.device) -> int:
    """Context tokens per tile: 64 on a GPU; 32 in the interpreter (fewer masked lanes)."""
    return 64 if device.type == "cuda" else 32


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_len: int, num_sms: int, block_n: int) -> int:
    """Context slices per sequence: enough programs for about two waves of the GPU's SMs,
    but no slice shorter than MIN_TILES_PER_SPLIT tiles."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = max(1, (2 * num_sms) // programs)
    most = max(1, math.ceil(max_len / (MIN_TILES_PER_SPLIT * block_n)))
    return min(wanted, most)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, *, max_len: int, rows: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, num_splits: int = 1, return_lse: bool = False,
                           block_n: int | None = None, skip: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of one query per sequence over its cached tokens.

    q: (num_tokens, num_heads, head_dim), last dim contiguous; the queries are the rows
    `rows` (num_seqs,) of q, or all of them. k_cache, v_cache: (num_blocks, block_size,
    num_kv_heads, head_dim). block_tables: (num_seqs, max_blocks) block ids; context_lens:
    (num_seqs,) tokens to attend to (0 allowed); max_len: their maximum, known on the host.
    Writes the rows of `out` (default: a new tensor like q) and returns (out, lse), lse
    (num_seqs, num_heads) float32 when `return_lse`, else None. `skip` (num_seqs,) int64: keys
    each query does not attend to, bit j for position context_len - 1 - j (a draft tree's
    rows; bit 0 never set)."""
    num_seqs = block_tables.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension")
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(num_seqs, num_heads, dtype=torch.float32, device=q.device) if return_lse else None
    if num_seqs == 0:
        return out, lse
    block_n = block_n or block_n_for(q.device)
    split_len = max(block_n, math.ceil(max(max_len, 1) / num_splits / block_n) * block_n)
    num_splits = max(1, math.ceil(max_len / split_len))
    has_rows = rows is not None
    rows_arg = rows if has_rows else context_lens  # unused when not HAS_ROWS
    common = dict(GROUP=group, BLOCK_H=max(16, next_power_of_2(group)), HEAD_DIM=head_dim,
                  BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=block_n,
                  HAS_ROWS=has_rows, HAS_SKIP=skip is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    grid = (num_seqs, num_kv_heads, num_splits)
    scale_log2 = scale * LOG2E
    if num_splits == 1:
        lse_arg = lse if lse is not None else out  # unused when not STORE_LSE
        lse_strides = (lse.stride(0), lse.stride(1), 0) if lse is not None else (0, 0, 0)
        _decode_kernel[grid](q, k_cache, v_cache, out, lse_arg, rows_arg, block_tables, context_lens,
                             skip if skip is not None else context_lens,
                             q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
                             out.stride(0), out.stride(1), 0, *lse_strides, block_tables.stride(0),
                             scale_log2, split_len, PARTIAL=False, STORE_LSE=lse is not None, **common)
        return out, lse
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[grid](q, k_cache, v_cache, part_out, part_lse, rows_arg, block_tables, context_lens,
                         skip if skip is not None else context_lens,
                         q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
                         *part_out.stride()[:3], *part_lse.stride(), block_tables.stride(0),
                         scale_log2, split_len, PARTIAL=True, STORE_LSE=True, **common)
    lse_arg = lse if lse is not None else part_lse
    _merge_kernel[(num_seqs, num_heads)](part_out, part_lse, out, lse_arg, rows_arg, num_splits,
                                         *part_out.stride()[:3], part_lse.stride(0), part_lse.stride(1),
                                         out.stride(0), out.stride(1), lse_arg.stride(0), lse_arg.stride(1),
                                         HEAD_DIM=head_dim, BLOCK_D=common["BLOCK_D"],
                                         BLOCK_S=max(2, next_power_of_2(num_splits)), HAS_ROWS=has_rows,
                                         STORE_LSE=lse is not None)
    return out, lse
