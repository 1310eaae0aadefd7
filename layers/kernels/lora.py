"""Multi-LoRA on the GPU: every row of a batch adds the delta of its own adapter, in place,
without merging any weight (Punica's and S-LoRA's shrink-expand pair).

    y[t] += (x[t] A[s]^T) B[s]^T,   s = slots[t]  (s < 0: no adapter, the row is left as it is)

A: (num_slots, r, in), B: (num_slots, out, r), stacked slots as engine/lora/slots.py keeps
them; the adapter's scaling is already folded into B. The torch reference is
meshserve.layers.lora_product.add_lora.

Two kernels, because the two products have different shapes and r is small:
1. `_shrink_kernel`, grid (rows, blocks of r): a program reads its row's slot, then reduces
   x[t] against the tile of A[s] over `in` in BLOCK_K chunks, into a float32 (rows, r) buffer.
   A row's r values are what every block of `out` needs, so they are computed once.
2. `_expand_kernel`, grid (rows, blocks of out): a program reads its row's r values (all of
   them: r is padded to a power of two, at least 16, and masked) and the tile of B[s], and
   adds their product to y.
Fusing the two would recompute the shrink in every block of `out`, or keep one program
per row walking all of `out`, with too few programs for a decode batch.

Rows whose slot is negative exit at once in both kernels. The products are tl.sum over
broadcast tiles (one row per program: tl.dot would need 16 rows); accumulation is float32,
and y is rounded to its dtype once, after the add. Different rows may use different
slots, so a batch needs no grouping by adapter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshserve.layers.kernels import next_power_of_2

BLOCK_K = 64
"""`in` per chunk of the shrink."""
MAX_BLOCK_R = 64
"""r per program of the shrink: a larger (stacked) r takes several programs per row."""
TILE = 4096
"""Elements of A or B a program holds at once (BLOCK_R * BLOCK_K, BLOCK_N * R_PAD)."""
MAX_BLOCK_N = 64
"""`out` per program of the expand; fewer for an r past TILE / MAX_BLOCK_N."""


@triton.jit
def _shrink_kernel(X, A, SLOTS, T, in_features, rank, stride_xt, stride_as, stride_ar, stride_tt,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """T[t, r] = sum_k A[s, r, k] X[t, k] for this program's block of r (float32)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + row).to(tl.int64)
    if slot < 0:
        return  # no adapter: the expand skips this row too, T's row is never read
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = A + slot * stride_as + offs_r[:, None] * stride_ar  # (BLOCK_R, 1)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for start in range(0, in_features, BLOCK_K):
        k = start + offs_k
        k_mask = k < in_features
        x = tl.load(X + row * stride_xt + k, mask=k_mask, other=0.0).to(tl.float32)  # (BLOCK_K,)
        a = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # (BLOCK_R, BLOCK_K)
        acc += tl.sum(a.to(tl.float32) * x[None, :], 1)
    tl.store(T + row * stride_tt + offs_r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(T, B, SLOTS, Y, out_features, rank, stride_tt, stride_bs, stride_bn, stride_yt,
                   R_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y[t, n] += sum_r B[s, n, r] T[t, r] for this program's block of out."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + row).to(tl.int64)
    if slot < 0:
        return  # no adapter: y's row is not even read
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < rank
    t = tl.load(T + row * stride_tt + offs_r, mask=r_mask, other=0.0)  # (R_PAD,) float32
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    b = tl.load(B + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # (BLOCK_N, R_PAD)
    delta = tl.sum(b.to(tl.float32) * t[None, :], 1)
    y_ptrs = Y + row * stride_yt + offs_n
    y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(Y.dtype.element_ty), mask=n_mask)


def _check(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or a.dim() != 3 or b.dim() != 3 or slots.dim() != 1:
        raise ValueError(f"lora_add wants y (rows, out), x (rows, in), slots (rows,), a (num_slots, r, in), "
                         f"b (num_slots, out, r); got y {tuple(y.shape)}, x {tuple(x.shape)}, "
                         f"slots {tuple(slots.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}")
    rows, in_features = x.shape
    num_slots, rank, out_features = a.shape[0], a.shape[1], y.shape[1]
    if (y.shape[0], slots.shape[0]) != (rows, rows) or a.shape[2] != in_features \
            or tuple(b.shape) != (num_slots, out_features, rank):
        raise ValueError(f"lora_add: shapes do not match: y {tuple(y.shape)}, x {tuple(x.shape)}, "
                         f"slots {tuple(slots.shape)}, a {tuple(a.shape)} (num_slots, r, in), "
                         f"b {tuple(b.shape)} (want ({num_slots}, {out_features}, {rank}))")
    if not (x.dtype == y.dtype == a.dtype == b.dtype) or x.dtype not in (torch.float16, torch.bfloat16,
                                                                         torch.float32):
        raise ValueError(f"lora_add wants y, x, a and b in one of float16, bfloat16, float32; got "
                         f"y {y.dtype}, x {x.dtype}, a {a.dtype}, b {b.dtype}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lora_add wants int32 or int64 slots, got {slots.dtype}")
    if any(t.stride(-1) != 1 for t in (y, x, a, b)) or slots.stride(0) != 1:
        raise ValueError("lora_add needs y, x, a and b with a contiguous last dimension, and contiguous slots")


def lora_add(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """y (rows, out) += the LoRA delta of each row of x (rows, in), in place: row t adds
    (x[t] a[s]^T) b[s]^T with s = slots[t] (rows,), int32 or int64; a row with s < 0 is
    left untouched. a: (num_slots, r, in), b: (num_slots, out, r), scaling folded into b;
    y, x, a and b in one dtype. Slots are not checked against num_slots on the device."""
    _check(y, x, slots, a, b)
    rows, in_features = x.shape
    rank, out_features = a.shape[1], y.shape[1]
    if rows == 0 or rank == 0 or out_features == 0:
        return
    r_pad = max(16, next_power_of_2(rank))
    block_r = min(r_pad, MAX_BLOCK_R)
    block_n = max(16, min(MAX_BLOCK_N, TILE // r_pad))
    shrunk = torch.empty(rows, rank, dtype=torch.float32, device=x.device)  # (rows, r)
    _shrink_kernel[(rows, triton.cdiv(rank, block_r))](
        x, a, slots, shrunk, in_features, rank, x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    _expand_kernel[(rows, triton.cdiv(out_features, block_n))](
        shrunk, b, slots, y, out_features, rank, shrunk.stride(0), b.stride(0), b.stride(1), y.stride(0),
        R_PAD=r_pad, BLOCK_N=block_n)
