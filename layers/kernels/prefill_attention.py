"""Prefill attention, flash-style: the queries of several sequences (varlen, packed rows
given by their start and length) over keys and values read from the paged KV cache,
returning the output and, on request, the log-sum-exp (LSE).

Grid (sequences, query heads, query tiles of BLOCK_M). A program keeps the running max and
sum of its tile's rows and walks the keys in tiles of BLOCK_N, finding each token's slot
through the block table. Masks:
- CAUSAL: query i of a chunk of q_len over kv_len cached tokens (its own included) is at
  position kv_len - q_len + i and sees keys 0..that position (a chunk after a cached prefix
  attends to the prefix and, causally, to itself); keys past the tile's last query are skipped;
- POSITIONS: query i sees key j iff k_pos[j] <= q_pos[i] (ring attention's shares of striped blocks);
- NONE: every key.
With `block_size=0` the keys are one contiguous (kv_len, num_kv_heads, head_dim) tensor
instead of a paged cache. LSE contract: natural log, float32, (num_queries, num_heads); a
row that sees no key gives out 0 and LSE -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshserve.layers.kernels import next_power_of_2

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # a kernel may read a global only if it is a constexpr
MASK_NONE, MASK_CAUSAL, MASK_POSITIONS = 0, 1, 2


@triton.jit(do_not_specialize=["stride_tab"])  # it varies with the batch: one compiled variant
def _prefill_kernel(Q, K, V, O, LSE, Q_STARTS, Q_LENS, KV_LENS, TABLES, Q_POS, K_POS,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_ot, stride_oh, stride_lt, stride_lh, stride_tab, scale_log2,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, STORE_LSE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_len = tl.load(Q_LENS + seq)
    if tile * BLOCK_M >= q_len:
        return
    kv_len = tl.load(KV_LENS + seq)
    row0 = tl.load(Q_STARTS + seq)
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = row0 + offs_m
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    hi = kv_len
    if MASK == 1:
        q_pos = kv_len - q_len + offs_m
        hi = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * BLOCK_M)
    if MASK == 2:
        q_pos = tl.load(Q_POS + rows, mask=m_valid, other=-1)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        valid = idx < hi
        if BLOCK_SIZE > 0:
            block = tl.load(TABLES + seq * stride_tab + idx // BLOCK_SIZE, mask=valid, other=0)
            k_off = block * stride_kb + (idx % BLOCK_SIZE) * stride_ks
            v_off = block * stride_vb + (idx % BLOCK_SIZE) * stride_vs
        else:
            k_off = idx.to(tl.int64) * stride_ks
            v_off = idx.to(tl.int64) * stride_vs
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(K + k_off[:, None] + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N)
        seen = valid[None, :]
        if MASK == 1:
            seen = seen & (idx[None, :] <= q_pos[:, None])
        if MASK == 2:
            k_pos = tl.load(K_POS + idx, mask=valid, other=0)
            seen = seen & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + v_off[:, None] + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_valid[:, None] & d_mask[None, :])
    if STORE_LSE:
        lse = tl.where(l > 0, (m + tl.log2(tl.maximum(l, 1e-30))) * LN2, float("-inf"))
        tl.store(LSE + rows * stride_lt + head * stride_lh, lse, mask=m_valid)


def tile_sizes(device: torch.device, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): GPU tiles in the usual flash-attention range; small
    ones in the interpreter, where each program runs serially."""
    if device.type != "cuda":
        return 16, 32, 1
    if head_dim <= 64:
        return 128, 64, 4
    return 64, 64, 4


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, q_starts: torch.Tensor,
                      q_lens: torch.Tensor, kv_lens: torch.Tensor, scale: float, *, max_query_len: int,
                      block_tables: torch.Tensor | None = None, q_pos: torch.Tensor | None = None,
                      k_pos: torch.Tensor | None = None, causal: bool = True, return_lse: bool = False,
                      tiles: tuple[int, int, int] | None = None) -> torch.Tensor | None:
    """Attention of packed query rows over paged (or contiguous) keys; writes `out`.

    q, out: (num_tokens, num_heads, head_dim), last dim contiguous; sequence s owns rows
    q_starts[s] .. q_starts[s] + q_lens[s] and attends to kv_lens[s] keys. With
    `block_tables` (num_seqs, max_blocks), k and v are the paged caches (num_blocks,
    block_size, num_kv_heads, head_dim); without, one contiguous (kv_len, num_kv_heads,
    head_dim) block of keys. Mask: `causal` (bottom-right aligned), or `q_pos` (num_tokens,)
    with `k_pos` (kv_len,) (query sees key iff k_pos <= q_pos), or none. Returns lse
    (num_tokens, num_heads) float32 when `return_lse` (rows outside the sequences are
    left unset), else None."""
    num_seqs = q_starts.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[-2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if q.stride(2) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or out.stride(2) != 1:
        raise ValueError("q, k, v and out need a contiguous last dimension")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos go together")
    lse = torch.empty(q.shape[0], num_heads, dtype=torch.float32, device=q.device) if return_lse else None
    if num_seqs == 0 or max_query_len == 0:
        return lse
    block_m, block_n, num_warps = tiles or tile_sizes(q.device, head_dim)
    mask = MASK_POSITIONS if q_pos is not None else MASK_CAUSAL if causal else MASK_NONE
    if block_tables is not None:
        block_size, tab_stride = k.shape[1], block_tables.stride(0)
        k_strides, v_strides = k.stride()[:3], v.stride()[:3]
    else:  # contiguous keys: no table, the slot is the key index
        block_size, k_strides, v_strides, tab_stride = 0, (0, *k.stride()[:2]), (0, *v.stride()[:2]), 0
    lse_arg = lse if lse is not None else out
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](q, k, v, out, lse_arg, q_starts, q_lens, kv_lens,
                          block_tables if block_tables is not None else q_lens,
                          q_pos if q_pos is not None else q_lens, k_pos if k_pos is not None else q_lens,
                          q.stride(0), q.stride(1), *k_strides, *v_strides, out.stride(0), out.stride(1),
                          *lse_strides, tab_stride, scale * LOG2E,
                          GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
                          BLOCK_D=max(16, next_power_of_2(head_dim)),
                          BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, MASK=mask,
                          STORE_LSE=lse is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                          num_warps=num_warps)
    return lse
