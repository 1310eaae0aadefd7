"""The int8 KV cache (config `cache.dtype: int8`): each (token, KV head) row of a layer's
cache is head_dim int8 codes followed by the row's float32 scale in four bytes, so the
cache tensors are int8 of shape (num_blocks, block_size, kv_heads, head_dim + 4) and a row
is codes * scale, with scale = absmax / 127 (symmetric, per token and head).

At head_dim 64 a row is 68 bytes instead of 128 in bf16: a decode step reads about half
the bytes from the cache, which at many long sequences rivals what it reads of int8
weights. New keys and values are quantized as they are stored; the attention of a prefill
chunk over itself uses them unquantized, later reads dequantize.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
"""A row's float32 scale, stored after its codes."""


def row_length(head_dim: int) -> int:
    """Bytes of one packed (token, KV head) row."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) -> packed rows (..., head_dim + 4) int8, in torch ops: the
    reference (and the path without the C++ library, or off the CPU; the cpu backend
    quantizes in one C++ pass, cpu_quantize_rows.cpp)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    codes = torch.round(xf * (1 / scale)).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows (..., head_dim + 4) int8 -> (..., head_dim) in `dtype`."""
    packed = packed.contiguous()
    scale = packed[..., -SCALE_BYTES:].view(torch.float32)
    return (packed[..., :-SCALE_BYTES].float() * scale).to(dtype)
