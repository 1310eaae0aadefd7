"""Fused mixture-of-experts: every token's top-k experts (gated SiLU MLPs) in two grouped
GEMMs, each expert's weights read once per block of tokens routed to it.

    out[t] = sum_j w[t, j] * W2[e] (silu(W1[e] x[t]) * W3[e] x[t]),  e = topk_ids[t, j]

with W1 = w13[e, :inter] (gate), W3 = w13[e, inter:] (up) and W2 = w2[e] (down), all in
nn.Linear layout (out x in); an id of -1 (the expert lives on another rank) adds nothing.

Three steps, as vLLM and SGLang do it:
1. `moe_align` (torch, on the device, no host sync): the (token, slot) pairs, pair
   p = t * top_k + j, sorted by expert, each expert's group padded to a multiple of
   BLOCK_M with the id num_pairs (masked out), the -1 pairs dropped; the expert of every
   block of BLOCK_M sorted pairs; the number of padded pairs. An expert that receives no
   pair gets no block.
2. `_grouped_gemm_kernel`, grid (blocks of sorted pairs, blocks of N): a program multiplies
   its block's rows by its expert's weight tile. First over w13 with silu-and-mul fused
   (the gate and up tiles of the same columns side by side, so the (num_pairs, 2 * inter)
   intermediate is never written): act (num_pairs, inter).
3. The same kernel over w2, the routing weight multiplied in the epilogue: one row per
   pair, (num_pairs, hidden); then a float32 sum over the top_k slots.

Accumulation is float32; act and the per-pair rows are stored in the activation dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from meshserve.layers.kernels import next_power_of_2


@triton.jit(do_not_specialize=["num_pairs"])  # it varies with the batch: one compiled variant
def _grouped_gemm_kernel(A, B, C, SORTED_PAIRS, BLOCK_EXPERTS, NUM_PADDED, WEIGHTS, num_pairs, N, K,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         TOP_K: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """C[p, n] = A[p // TOP_K] . B[e, n] for the pairs p of this block (expert e). GATED:
    B holds 2N rows and C[p, n] = silu(A . B[e, n]) * (A . B[e, N + n]). MUL_WEIGHT: times
    WEIGHTS[p]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NUM_PADDED):
        return  # the grid is sized for the worst case (no host sync); past the last group
    expert = tl.load(BLOCK_EXPERTS + pid_m).to(tl.int64)
    pairs = tl.load(SORTED_PAIRS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = pairs < num_pairs  # padding of the expert's group
    rows = pairs // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(b.dtype)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(WEIGHTS + pairs, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(C + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the (token, slot) pairs by expert, each group padded to a multiple of block_m.

    topk_ids: (num_tokens, top_k), ids in [0, num_experts) or -1 (dropped). Pair p is
    (p // top_k, p % top_k). Returns, all on topk_ids' device and without a host sync:
    sorted_pair_ids (max_blocks * block_m,) int32: pair ids by expert (by pair id within an
    expert), padding = num_pairs; block_expert_ids (max_blocks,) int32: each block's expert,
    -1 past the last group; num_padded (1,) int64: the pairs of all groups, padding included.
    max_blocks bounds the blocks whatever the routing (num_pairs + (block_m - 1) per expert
    that receives a pair)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    key = torch.where(flat >= 0, flat, num_experts)  # dropped pairs sort after the last expert
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # (num_experts + 1,); bincount would sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts

    order = torch.sort(key, stable=True).indices  # pair ids, grouped by expert
    sorted_key = key[order]
    rank = torch.arange(num_pairs, device=device) - count_start[sorted_key]  # place within its expert's group
    max_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m
    size = max_blocks * block_m
    dest = torch.where(sorted_key < num_experts, padded_start[sorted_key] + rank, size)  # dropped: one past the end
    sorted_pair_ids = torch.full((size + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_pair_ids = sorted_pair_ids[:size]

    num_padded = padded_end[num_experts:]  # (1,)
    block_starts = torch.arange(max_blocks, device=device) * block_m
    # a block's expert: the number of groups that end at or before its start (empty groups skipped)
    block_expert_ids = torch.searchsorted(padded_end[:num_experts], block_starts, right=True)
    block_expert_ids = torch.where(block_starts < num_padded, block_expert_ids, -1).to(torch.int32)
    return sorted_pair_ids, block_expert_ids, num_padded


def choose_block_sizes(num_pairs: int, num_experts: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): BLOCK_M near the mean pairs per expert (16 to 64, less
    padding at decode), BLOCK_N and BLOCK_K the sizes up to 64 (tl.dot needs >= 16)."""
    block_m = min(64, max(16, next_power_of_2(math.ceil(num_pairs / num_experts))))
    return block_m, min(64, max(16, next_power_of_2(n))), min(64, max(16, next_power_of_2(k)))


def _launch(a, b, c, align, num_pairs, n, k, top_k, gated, weights, blocks, dot_precision):
    sorted_pair_ids, block_expert_ids, num_padded = align
    block_m, block_n, block_k = blocks
    grid = (block_expert_ids.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](a, b, c, sorted_pair_ids, block_expert_ids, num_padded,
                               weights if weights is not None else num_padded, num_pairs, n, k,
                               a.stride(0), a.stride(1), *b.stride(), *c.stride(),
                               TOP_K=top_k, GATED=gated, MUL_WEIGHT=weights is not None,
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=dot_precision)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, *, block_sizes: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The routed experts' gated SiLU MLPs, weighted and summed per token.

    x: (num_tokens, hidden); w13: (num_experts, 2 * inter, hidden), gate rows then up rows;
    w2: (num_experts, hidden, inter); topk_ids: (num_tokens, top_k) int32/int64 in
    [0, num_experts), or -1 for an expert not on this rank (adds nothing), no id twice in a
    row; topk_weights: (num_tokens, top_k) float32. Returns (num_tokens, hidden) in x.dtype:
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :inter] @ x[t]) * w13[e, inter:] @ x[t]),
    e = topk_ids[t, j]. `block_sizes` (BLOCK_M, BLOCK_N, BLOCK_K, powers of two >= 16)
    overrides `choose_block_sizes` (the same for both GEMMs).

    NOTE: under TRITON_INTERPRET=1 this runs on CPU tensors: that is how the tests check it."""
    num_tokens, hidden = x.shape
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    inter = two_inter // 2
    if two_inter % 2 or w13.shape != (num_experts, two_inter, hidden) or w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"fused_moe: x {tuple(x.shape)} needs w13 (num_experts, 2 * inter, {hidden}) and "
                         f"w2 (num_experts, {hidden}, inter); got w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be (num_tokens={num_tokens}, top_k)")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: x, w13, w2 must share a dtype; got {x.dtype}, {w13.dtype}, {w2.dtype}")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"
    if block_sizes is not None and (len(block_sizes) != 3 or any(b < 16 or b & (b - 1) for b in block_sizes)):
        raise ValueError(f"fused_moe: block_sizes {block_sizes} must be three powers of two >= 16")
    if block_sizes is None:
        blocks_13 = choose_block_sizes(num_pairs, num_experts, inter, hidden)
        blocks_2 = choose_block_sizes(num_pairs, num_experts, hidden, inter)  # the same BLOCK_M: one alignment
    else:
        blocks_13 = blocks_2 = block_sizes
    align = moe_align(topk_ids, num_experts, blocks_13[0])

    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # rows of dropped pairs stay unwritten, unread
    _launch(x, w13, act, align, num_pairs, inter, hidden, top_k, True, None, blocks_13, dot_precision)
    # (num_pairs, inter)
    per_pair = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)  # dropped pairs: 0
    _launch(act, w2, per_pair, align, num_pairs, hidden, inter, 1, False, topk_weights.reshape(-1).contiguous(),
            blocks_2, dot_precision)
    # (num_pairs, hidden) -> (num_tokens, hidden)
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
