"""RMSNorm fused with the residual add that precedes it: one read of x and the residual,
one write of the norm and of the new residual.

Rounding follows the torch reference (meshserve.layers.norm.rms_norm) step by step: the sum
is rounded to the activation dtype before it is normed, the normed value is rounded
before it is scaled by the weight; the mean of squares is taken in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshserve.layers.kernels import next_power_of_2


@triton.jit
def _rms_norm_kernel(X, R, W, Y, R_OUT, stride_x, stride_r, stride_y, stride_ro, n_cols, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(R_OUT + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (normed * w).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x, residual: (num_tokens, hidden_size). Without `residual`: norm(x). With it:
    (norm(x + residual), x + residual), the second being the next residual."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs rows with a contiguous last dimension")
    x2 = x.reshape(-1, x.shape[-1])
    n_rows, n_cols = x2.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    block = next_power_of_2(n_cols)
    num_warps = min(16, max(1, block // 256))
    if residual is None:
        if n_rows:
            _rms_norm_kernel[(n_rows,)](x2, x2, weight, y, y, x2.stride(0), 0, y.stride(0), 0, n_cols, eps,
                                        BLOCK=block, HAS_RESIDUAL=False, num_warps=num_warps)
        return y.view(x.shape)
    r2 = residual.reshape(-1, n_cols)
    new_residual = torch.empty_like(x2)
    if n_rows:
        _rms_norm_kernel[(n_rows,)](x2, r2, weight, y, new_residual, x2.stride(0), r2.stride(0), y.stride(0),
                                    new_residual.stride(0), n_cols, eps, BLOCK=block, HAS_RESIDUAL=True,
                                    num_warps=num_warps)
    return y.view(x.shape), new_residual.view(x.shape)
