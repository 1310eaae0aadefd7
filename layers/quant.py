"""Quantized matmuls on the CPU: y = x W^T with W stored in 8 or 4 bits and x, y in the
activation dtype. One stream of decode reads every weight once per token, so its time is
the weight bytes over the memory bandwidth; fewer bytes, faster tokens. Batches are
compute bound instead, which only 8-bit inputs help (w8a8).

- int4, groups of 32 along the input dim, asymmetric (scale and min per group): GGUF's
  Q4_1 layout, so a Q4_1 checkpoint's own 4-bit codes come back exactly (its quantizer
  maps each group's min to code 0 and max to 15, which is what `quantize_int4` does
  again on the dequantized values). Multiplied by `_weight_int4pack_mm_for_cpu`, which
  computes (q - 8) * scale + zero with zero = min + 8 * scale.
- int8, one symmetric scale per output row (`_weight_int8pack_mm`). The LM head with
  bf16 activations also quantizes its input to int8 per row, as llama.cpp does for every
  matmul, and multiplies int8 by int8 (`torch._int_mm`) where the CPU has VNNI or AMX int8:
  faster than the weight-only kernel at a small cost in perplexity (scripts/quant_quality.py).
  float32 runs keep the weight-only head: they are the precise ones.

At one row these read their bytes as fast as the packed bf16 kernel reads its own, so a
token costs 1/4 (int4) or 1/2 (int8) of the bf16 bytes; at batch sizes they are slower than
packed bf16 (compute bound on unpacking; scripts/bench_matmul.py), so they are for few
streams, not for batches.

- w8a8: int8 weights (one scale per output row) times activations quantized to 8 bits per
  row as they come, on every linear and the head, through oneDNN's u8 x s8 kernel (VNNI:
  twice the multiply-adds per instruction of bf16), faster than bf16 at prefill and batch
  sizes. The weights are smoothed first (meshserve.layers.smoothquant), which brings most of
  the perplexity cost back (scripts/quant_quality.py).

Which of these a linear runs is chosen once at load (meshserve.layers.matmul_plan).
"""

from __future__ import annotations

import torch

from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.memory import INT4_GROUP
from meshserve.layers.kernels.cpu_library import CpuLibrary


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


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """(m, k) float32 -> (m, 1): each row's absmax / 127, the step of its symmetric 8-bit codes."""
    return rows.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127


DENSE_INT4_ROWS = 256
"""From this many rows (a prefill chunk) on a CPU without bf16 dot products, an int4 matmul
dequantizes its weight to float32 and runs oneDNN's float32 product instead: the int4
kernel is bound by unpacking there; at decode sizes it is the faster one."""


def kernel_dtype(act_dtype: torch.dtype) -> torch.dtype:
    """The input dtype of the weight-only int4/int8 kernels for `act_dtype` activations:
    float32 inputs are rounded to bfloat16 for the product (far below the weights' own
    rounding), since torch's float32 versions of these kernels are many times slower than its
    bfloat16 ones."""
    return torch.bfloat16 if act_dtype == torch.float32 else act_dtype


class Int4Matmul:
    """x W^T with W in int4 groups of 32, packed once for the CPU kernel. On a CPU without
    bf16 dot products it also keeps the codes two to a byte (half a byte per weight more),
    for the float32 product of many rows (DENSE_INT4_ROWS)."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype):
        codes, scale, low = quantize_int4(weight)
        self.out_features = weight.shape[0]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.kernel_dtype = kernel_dtype(act_dtype)
        # (in // group, out, 2): the kernel's (scale, zero) with zero = min + 8 * scale
        self.scales_zeros = (torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).contiguous()
                             .to(self.kernel_dtype))
        self.nibbles = None
        if not cpu_features().bf16_compute:
            pairs = codes.to(torch.uint8).view(self.out_features, -1, 2)
            self.nibbles = pairs[..., 0] | (pairs[..., 1] << 4)
            self.scale, self.low = scale, low

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.nibbles is not None and rows >= DENSE_INT4_ROWS and not torch.compiler.is_compiling():
            return torch.nn.functional.linear(x.float(), self.dequantized()).to(x.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.kernel_dtype), self.packed, INT4_GROUP,
                                                       self.scales_zeros)
        return y.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """W in float32 (out, in), from the nibbles."""
        codes = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).view(self.out_features, -1)
        return dequantize_int4(codes, self.scale, self.low)


class Int8Matmul:
    """x W^T with W in int8, one scale per output row."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype):
        self.codes, scale = quantize_int8(weight)
        self.out_features = weight.shape[0]
        self.scale = scale.to(kernel_dtype(act_dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(self.scale.dtype), self.codes, self.scale).to(x.dtype)


class Int8DynamicMatmul:
    """x W^T with W in int8 (one scale per row) and x quantized to int8 per row as it comes."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype):
        self.codes, self.scale = quantize_int8(weight)  # the scale stays float32: the product is rescaled in float32
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int8_dynamic_linear(x, self.codes, self.scale)


SLOW_INT_MM_ROWS = range(2, 8)
"""Row counts where one `_int_mm` call is slower than one per row (measured at an LM head's
shape; from 8 rows one call is faster)."""


@torch.library.custom_op("meshserve::int8_dynamic_linear", mutates_args=())
def int8_dynamic_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x W^T for W = codes * scale (per row): x quantized to int8 per row (symmetric, its
    absmax to 127), an int8 x int8 -> int32 product, then both scales. One opaque op for
    torch.compile."""
    rows = x.reshape(-1, x.shape[-1]).float()
    x_scale = row_scales(rows)
    xq = (rows / x_scale).round_().to(torch.int8)
    if len(xq) in SLOW_INT_MM_ROWS:
        acc = torch.cat([torch._int_mm(row[None], codes.t()) for row in xq])
    else:
        acc = torch._int_mm(xq, codes.t())
    return (acc * x_scale * scale).to(x.dtype).view(*x.shape[:-1], codes.shape[0])


@int8_dynamic_linear.register_fake
def _int8_dynamic_linear_shape(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


class W8A8Matmul:
    """x W^T with W in int8 (one scale per output row) and x quantized to 8 bits per row as
    it comes (symmetric, its absmax to 127, stored as uint8 around 128), multiplied by
    oneDNN's u8 x s8 kernel (VNNI), which applies W's scales; x's row scales follow. All
    three in one C++ op (cpu_quantize_rows.cpp) of `library` where it built, eager or
    compiled; else in torch ops around the product. Where the CPU has AMX-INT8 (and the
    avx512 build), the product is AmxW8A8's instead."""

    AMX_STEP_K = 64
    """Inputs an AMX int8 tile row holds: in-features a multiple of it take the AMX product."""

    def __init__(self, weight: torch.Tensor, library: CpuLibrary | None, *, amx: bool = True):
        """`amx`: take the AMX int8 product where it runs (False: oneDNN's, as elsewhere)."""
        if not cpu_features().vnni:
            raise ValueError(f"w8a8 needs a CPU with VNNI for oneDNN's u8 x s8 product; this one has "
                             f"{cpu_features().describe()} (config validation refuses it before any rank starts)")
        codes, self.scale = quantize_int8(weight)
        self.out_features, self.in_features = weight.shape
        self.amx = None
        if amx and amx_int8_runs(library) and self.in_features % self.AMX_STEP_K == 0:
            self.amx = AmxW8A8(codes, self.scale, library)
            return
        self.packed = torch.ops.onednn.qlinear_prepack(codes, None)
        self.zero = torch.zeros(self.out_features, dtype=torch.int64)
        self.native = None if library is None else library.ops.w8a8_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx is not None:
            return self.amx(x)
        if self.native is not None:
            return self.native(x, self.packed, self.scale, self.zero)
        codes, x_scale = quantize_rows_u8(x.reshape(-1, self.in_features))
        if torch.compiler.is_compiling():
            y = (w8a8_matmul(codes, self.packed, self.scale, self.zero, x.dtype) * x_scale).to(x.dtype)
        else:
            y = _w8a8_matmul(codes, self.packed, self.scale, self.zero, x.dtype).mul_(x_scale)
        return y.view(*x.shape[:-1], self.out_features)


def amx_int8_runs(library: CpuLibrary | None) -> bool:
    """Whether w8a8 products go through AMX's int8 tiles: the avx512 build on a CPU with AMX-INT8."""
    return library is not None and library.isa == "avx512" and cpu_features().amx_int8


class AmxW8A8:
    """The w8a8 product on AMX's int8 tiles (layers/kernels/cpu_amx_linear.cpp
    amx_w8a8_linear): the weight's int8 codes in tile order, each output's scale and code sum
    (the zero point of x's uint8 codes times it comes off the int32 sums exactly), x's rows
    quantized inside the op. The same numbers as oneDNN's u8 x s8 product up to the float32
    order of the scales."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, library: CpuLibrary):
        self.out_features = codes.shape[0]
        self.packed = library.ops.amx_pack_s8(codes)
        padded = self.packed.shape[0] * 32
        self.scale = torch.zeros(padded)
        self.scale[: self.out_features] = scale.float().view(-1)
        self.sums = torch.zeros(padded, dtype=torch.int32)
        self.sums[: self.out_features] = codes.sum(dim=1, dtype=torch.int32)
        self.op = library.ops.amx_w8a8_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.packed, self.scale, self.sums, self.out_features)


U8_ZERO = 128
"""uint8 codes of the activations: round(x / scale) + 128, in [1, 255]."""


def quantize_rows_u8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, k) float -> uint8 codes (m, k) and float32 scales (m, 1), rows ~= (codes - 128) * scale."""
    rows = rows.float()
    scale = row_scales(rows)
    return (rows / scale).round_().add_(U8_ZERO).to(torch.uint8), scale


def _w8a8_matmul(codes: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.onednn.qlinear_pointwise(codes, 1.0, U8_ZERO, packed, scale, zero, None, 1.0, 0, dtype, "none",
                                              [], "")


@torch.library.custom_op("meshserve::w8a8_matmul", mutates_args=())
def w8a8_matmul(codes: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The u8 x s8 product, one opaque op for torch.compile (which cannot trace oneDNN's
    packed weight); the quantization around it stays in the graph, fused by inductor."""
    return _w8a8_matmul(codes, packed, scale, zero, dtype)


@w8a8_matmul.register_fake
def _w8a8_matmul_shape(codes, packed, scale, zero, dtype):
    return codes.new_empty((codes.shape[0], scale.shape[0]), dtype=dtype)
