"""How a linear layer multiplies: y = x W^T, by the weight as stored (any device), by a
weight-only quantized copy (meshserve.layers.quant, model.quantization), or by a copy
packed once into oneDNN's blocked layout (on CPU, where the kernels otherwise
re-layout the weight on every call), or, for bfloat16 on a CPU that cannot multiply it,
by float32 products of many rows (WidenedCpuMatmul), or, on a CPU with AVX2 or AVX-512, by
meshserve's own product of the weight permuted into panels (DenseCpuMatmul; a bf16 weight on a
CPU with bf16 dot products keeps oneDNN's). oneDNN's
packing, measured here with SmolLM2's shapes on 2 cores: bf16 2x faster at decode sizes; float32 2.5-4x at 32 rows (1047 -> 275 us for the 576 x 3072
gate/up; 22 -> 5 ms for the 49152-row head) and 3.5x for the head at one row, a few us
slower for the smallest matrices at one row."""

from __future__ import annotations

import torch

from meshserve.configs.cpu_features import cpu_features
from meshserve.layers.kernels import cpu_library
from meshserve.layers.quant import quantized_matmul


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
    torch's bf16 kernel, which there widens element by element in its inner loop). SmolLM2's
    shapes on an AVX2 EPYC, 2 threads: 576 -> 3072 at 32 rows 7.5 -> 2.1 ms, at 128 rows
    29.8 -> 4.7 ms; the 49152-row head at 32 rows 119 -> 62 ms; at 8 rows and fewer the
    widening costs more than it saves (the head's at 1 row: 4.1 vs 37 ms)."""

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
    On a 2-core EPYC (AVX2, no AVX-512) it streams SmolLM2's weights at one row ~2x faster
    than oneDNN's packed float32 product and is ahead of it up to 512 rows; on a 2-core Ice Lake
    Xeon (AVX-512, no AMX; scripts/bench_decode_products.py) 2.4x / 2.3x / 1.5x at 1 / 8 / 32
    rows with the weights kept in bf16, 1.4x / 1.4x / 1.2x in float32. `rows(ids)` looks up
    rows of the weight (a tied embedding's table, which this copy replaces)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features = weight.shape[0]
        self.dtype = weight.dtype
        """The model's dtype for this weight (of the rows looked up); the panels may keep it in
        bf16 (`bf16_exact`)."""
        stored = weight.detach().contiguous()
        if bf16_exact(stored):
            stored = stored.to(torch.bfloat16)
        self.weight = cpu_library.ops.pack_panels(stored)
        self.op = cpu_library.ops.dense_linear
        self.gather = cpu_library.ops.panel_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gather(self.weight, ids).to(self.dtype)


def kept_in_bf16(model: torch.nn.Module) -> tuple[int, int]:
    """(how many of `model`'s C++ products keep a float32 weight in bf16, how many run)."""
    dense = [m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), DenseCpuMatmul)]
    return sum(d.weight.dtype != d.dtype for d in dense), len(dense)


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


def dense_kernel_helps(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and dense_kernel_chosen(weight.device, weight.dtype)


def dense_kernel_chosen(device: torch.device | str, dtype: torch.dtype) -> bool:
    """On the CPU with a vector build of meshserve's kernels selected (avx2, avx512), for float32,
    and for bfloat16 where the CPU has no bf16 dot products (with AMX or AVX512-BF16 oneDNN's
    bf16 product is the faster one)."""
    if torch.device(device).type != "cpu" or cpu_library.ops is None or cpu_library.selected_isa not in DENSE_ISAS:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and not cpu_features().bf16_compute)


def widening_helps(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and not cpu_features().bf16_compute)


def prepared_matmul(weight: torch.Tensor, quantization: str = "none", act_dtype: torch.dtype | None = None, *,
                    int8_activations: bool = False):
    """What a loaded weight is multiplied by from now on: a quantized copy (`quantization`
    int8 | int4, activations in `act_dtype`; `int8_activations`: see quantized_matmul), else
    meshserve's C++ product, else a packed copy where packing helps, else None (the weight
    as stored)."""
    prepared = quantized_matmul(weight, quantization, act_dtype or weight.dtype, int8_activations=int8_activations)
    if prepared is None and dense_kernel_helps(weight):
        prepared = DenseCpuMatmul(weight)
    if prepared is None and packing_helps(weight):
        prepared = PackedCpuMatmul(weight)
    if prepared is None and widening_helps(weight):
        prepared = WidenedCpuMatmul(weight)
    return prepared


def packing_helps(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
