"""GGUF blocks to float32 in torch for the common llama.cpp types (Q4_0, Q4_1, Q8_0).

gguf.quants dequantizes in numpy, a group of rows at a time (a second or more of every
start for a 135M model); these are whole-tensor torch ops with the same arithmetic (the
float16 scales widened, then one multiply and one add in float32), so the values equal
gguf's bit for bit. Every other type goes through gguf.quants.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize


def _half(blocks: torch.Tensor, lo: int) -> torch.Tensor:
    return blocks[..., lo:lo + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml packs a block's values j and j + 16 into the low and high nibbles of byte j."""
    return torch.cat((qs & 15, qs >> 4), -1).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * (_nibbles(blocks[..., 2:]) - 8)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _nibbles(blocks[..., 4:]) + _half(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()


_TORCH = {GGMLQuantizationType.Q4_0: _q4_0, GGMLQuantizationType.Q4_1: _q4_1, GGMLQuantizationType.Q8_0: _q8_0}


def dequantize_rows(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Float32 (rows, values) of `data`, quantized rows as bytes (rows, bytes per row)."""
    fast = _TORCH.get(qtype)
    if fast is None:
        return torch.from_numpy(np.array(dequantize(np.ascontiguousarray(data), qtype), dtype=np.float32))
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = data.shape[0]
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8)).view(rows, -1, type_size)  # a writable copy
    return fast(blocks).reshape(rows, -1)
