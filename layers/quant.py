"""Weight-only quantized matmuls on the CPU: y = x W^T with W stored in 8 or 4 bits and
x, y in the activation dtype. One stream of decode reads every weight once per token, so
its time is the weight bytes over the memory bandwidth; fewer bytes, faster tokens.

- int4, groups of 32 along the input dim, asymmetric (scale and min per group): GGUF's
  Q4_1 layout, so a Q4_1 checkpoint's own 4-bit codes come back exactly (its quantizer
  maps each group's min to code 0 and max to 15, which is what `quantize_int4` does
  again on the dequantized values). Multiplied by `_weight_int4pack_mm_for_cpu`, which
  computes (q - 8) * scale + zero with zero = min + 8 * scale.
- int8, one symmetric scale per output row (`_weight_int8pack_mm`).

Measured here (scripts/bench_matmul.py): at one row these read their bytes as fast as the
packed bf16 kernel reads its own, so a token costs 1/4 (int4) or 1/2 (int8) of the
bf16 bytes; at 32 rows they are 2-2.5x slower than packed bf16 (they are compute bound
on unpacking), so they are for few streams, not for batches.
"""

from __future__ import annotations

import torch

from meshserve.configs.memory import INT4_GROUP

QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int4")


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float -> codes (out, in) int32 in [0, 15], scale and min (out, in // group)
    float32, with weight ~= codes * scale + min per group."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(f"int4 needs the input size ({in_features}) to be a multiple of the group size ({group})")
    grouped = weight.float().view(out_features, in_features // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((grouped - low[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.int32)
    return codes.view(out_features, in_features), scale, low


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    out_features, in_features = codes.shape
    grouped = codes.view(out_features, in_features // group, group).float()
    return (grouped * scale[..., None] + low[..., None]).view(out_features, in_features)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> codes (out, in) int8 and one float32 scale per output row."""
    scale = weight.float().abs().amax(dim=1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (weight.float() / safe[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scale


class Int4Matmul:
    """x W^T with W in int4 groups of 32, packed once for the CPU kernel."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype):
        codes, scale, low = quantize_int4(weight)
        self.out_features = weight.shape[0]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        # (in // group, out, 2): the kernel's (scale, zero) with zero = min + 8 * scale
        self.scales_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).contiguous().to(act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)


class Int8Matmul:
    """x W^T with W in int8, one scale per output row."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype):
        self.codes, scale = quantize_int8(weight)
        self.out_features = weight.shape[0]
        self.scale = scale.to(act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)


def quantized_matmul(weight: torch.Tensor, quantization: str, act_dtype: torch.dtype):
    """The quantized multiply for `weight` ((out, in), loaded at full precision), or None
    for `none`."""
    if quantization == "none":
        return None
    if weight.device.type != "cpu":
        raise ValueError(f"model.quantization={quantization} is a CPU path; the weight is on {weight.device}")
    if quantization == "int4":
        return Int4Matmul(weight, act_dtype)
    if quantization == "int8":
        return Int8Matmul(weight, act_dtype)
    raise ValueError(f"unknown quantization {quantization!r} ({', '.join(QUANTIZATIONS)})")
