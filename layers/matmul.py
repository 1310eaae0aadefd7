"""The products a linear layer multiplies by: y = x W^T by the weight as stored (any
device), by a copy packed once into oneDNN's blocked layout (on CPU, where the kernels
otherwise re-layout the weight on every call), by float32 products of many rows for bfloat16
on a CPU that cannot multiply it (WidenedCpuMatmul), or by meshserve's own product of the
weight permuted into panels (DenseCpuMatmul, the avx2 and avx512 builds). The weight-only
quantized ones are in meshserve.layers.quant; which one each kind of linear runs is chosen
once at load (meshserve.layers.matmul_plan). oneDNN's packing is faster than the unpacked
kernel at decode sizes in bf16, and far faster in float32 from a few rows on (the LM head
most), a little slower for the smallest matrices at one row."""

from __future__ import annotations

import torch

from meshserve.layers.kernels.cpu_library import CpuLibrary

DENSE_ISAS = {"avx512": "AVX-512", "avx2": "AVX2"}
"""The builds of the C++ kernels with meshserve's product (cpu_dense_linear.cpp), by name."""


class PackedCpuMatmul:
    BATCH_HINT = 32
    """oneDNN picks its kernel for this many rows; any row count stays correct."""

    def __init__(self, weight: torch.Tensor):
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


@torch.library.custom_op("meshserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The packed multiply as one opaque op for torch.compile (engine/compiled_decode.py),
    which calls it as it is; eager calls skip this wrapper's dispatch cost."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


class WidenedCpuMatmul:
    """A bfloat16 weight on a CPU without bf16 dot products (AVX512-BF16, AMX): from
    WIDEN_ROWS rows the weight is widened to float32 for each call and multiplied by
    oneDNN's float32 product, the result rounded back to bfloat16 (float32 sums, as
    torch's bf16 kernel, which there widens element by element in its inner loop). Below
    WIDEN_ROWS rows the widening costs more than it saves."""

    WIDEN_ROWS = 16

    def __init__(self, weight: torch.Tensor):
        self.out_features = weight.shape[0]
        self.weight = weight.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < self.WIDEN_ROWS:
            return torch.nn.functional.linear(x, self.weight)
        return torch.nn.functional.linear(x.float(), self.weight.float()).to(x.dtype)


class DenseCpuMatmul:
    """meshserve's C++ product for the avx2 and avx512 builds (layers/kernels/cpu_dense_linear.cpp):
    the float32 or bfloat16 weight permuted once into panels of 16 rows stored k-major (same
    shape: it replaces the weight; a float32 weight of bf16 numbers is kept in bf16, half the
    bytes, see bf16_exact), multiplied as outer products of 16 weight columns and up to 6 input
    rows in AVX2 registers (32 columns and 12 rows in AVX-512's), a bf16 weight widened there.
    It streams decoders' weights faster than oneDNN's packed float32 product at decode and
    batch sizes (README's tables, scripts/bench_decode_products.py). `rows(ids)` looks up
    rows of the weight (a tied embedding's table, which this copy replaces)."""

    def __init__(self, weight: torch.Tensor, library: CpuLibrary):
        self.out_features = weight.shape[0]
        self.dtype = weight.dtype
        """The model's dtype for this weight (of the rows looked up); the panels may keep it in
        bf16 (`bf16_exact`)."""
        stored = weight.detach().contiguous()
        if bf16_exact(stored):
            stored = stored.to(torch.bfloat16)
        self.weight = library.ops.pack_panels(stored)
        self.op = library.ops.dense_linear
        self.gather = library.ops.panel_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gather(self.weight, ids).to(self.dtype)


class AmxCpuMatmul:
    """meshserve's AMX product (layers/kernels/cpu_amx_linear.cpp): a bfloat16 weight whose
    inputs are a multiple of STEP_K, permuted once into AMX tile order (a copy; N padded to 32),
    multiplied by AMX's bf16 tiles into float32 sums, 32 outputs by up to 32 rows a pass, each
    block of the weight one sequential stream. The avx512 build on a CPU with AMX-BF16.
    `float_out`: the float32 sums are the output (the LM head's logits), not rounded to bf16.
    `silu_mul`: the weight is the MLP's gate/up [gate; up] and the output silu(gate) * up, as
    silu_and_mul gives it: the rows interleaved 16 by 16 before packing, so that each block's
    tiles hold 16 gates and their ups, combined as they leave the tiles (amx_linear_silu)."""

    STEP_K = 32
    """Inputs a tile row holds: the weight's in-features must be a multiple."""
    SILU_ROWS = 32
    """silu_mul: the gate/up weight's rows must be a multiple (16 gates and 16 ups a block)."""

    def __init__(self, weight: torch.Tensor, library: CpuLibrary, float_out: bool = False, silu_mul: bool = False):
        self.out_features, self.float_out, self.silu_mul = weight.shape[0], float_out, silu_mul
        weight = weight.detach()
        if silu_mul:
            self.out_features = weight.shape[0] // 2
            weight = weight.view(2, -1, 16, weight.shape[1]).transpose(0, 1).reshape(weight.shape)
        self.packed = library.ops.amx_pack(weight)
        self.op = (library.ops.amx_linear_f32 if float_out else
                   library.ops.amx_linear_silu if silu_mul else library.ops.amx_linear)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.packed, self.out_features)


def bf16_exact(weight: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """Whether every element of a float32 `weight` is a bfloat16 number (its low 16 bits
    zero), as a bf16 checkpoint's weights are once read in float32. Kept in bf16 they are the
    same numbers in half the bytes, and meshserve's product widens them back exactly: a
    float32 model's products are unchanged and read half as much."""
    if weight.dtype != torch.float32 or weight.numel() == 0:
        return False
    bits = weight.detach().reshape(-1).view(torch.int32)
    parts = (bits[:4096], *bits[4096:].split(chunk))  # a float32 weight shows itself in its first elements
    return not any(bool(torch.any(part & 0xFFFF)) for part in parts)
