"""Which product each kind of linear multiplies by, chosen once at load from the device, the
dtype, model.quantization and the loaded build of the C++ kernels: a `MatmulKernel` per kind
(the decoder layers' linears, the LM head, the MoE routers), together a `MatmulPlan`. A
kernel prepares a weight (returns what multiplies it from then on, None for the weight as
stored) and says what it is, for the start-up line; the plan counts the weights kept in
bf16, which the MBU cost reads. Nothing else decides or re-derives the choice.

The choice for unquantized weights, in order: meshserve's AMX product for bf16 on the avx512
build where the CPU has AMX-BF16; meshserve's C++ product in panels on the avx2/avx512 builds
(float32, and bf16 where the CPU has no bf16 dot products: with AVX512-BF16 oneDNN's bf16
product is the faster one); else oneDNN's packed product where oneDNN multiplies the dtype;
else, for bf16 without bf16 dot products, widened float32 products of many rows; else the
weight as stored (torch's product; CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.quantization import Quantization
from meshserve.layers.kernels.cpu_library import CpuLibrary
from meshserve.layers.matmul import DENSE_ISAS, AmxCpuMatmul, DenseCpuMatmul, PackedCpuMatmul, WidenedCpuMatmul
from meshserve.layers.quant import Int4Matmul, Int8DynamicMatmul, Int8Matmul, W8A8Matmul, amx_int8_runs, kernel_dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class MatmulKernel:
    """How the weights of one kind of linear are multiplied."""

    def product(self, weight: torch.Tensor):
        """What `weight` ((out, in), as loaded) is multiplied by: a callable x -> x W^T, or
        None for the weight as stored (F.linear)."""
        return None

    def prepare(self, weight: torch.Tensor):
        """`product` for one of the model's weights (a kernel may count what it prepared)."""
        return self.product(weight)

    def silu_mul_product(self, weight: torch.Tensor):
        """For the MLP's gate/up weight [gate; up]: a callable x -> silu(x gate^T) * (x up^T),
        the activation fused into the product, or None where this kernel has none."""
        return None

    def describe(self) -> str:
        raise NotImplementedError


@dataclass
class StoredWeight(MatmulKernel):
    """torch's product of the weight as stored."""

    dtype: torch.dtype

    def describe(self) -> str:
        return f"torch {_name(self.dtype)}"


@dataclass
class OneDnnPacked(MatmulKernel):
    """oneDNN's product on a copy packed once into its blocked layout."""

    dtype: torch.dtype

    def product(self, weight):
        return PackedCpuMatmul(weight)

    def describe(self) -> str:
        return f"oneDNN packed {_name(self.dtype)}"


class WidenedBf16(MatmulKernel):
    """bf16 weights on a CPU without bf16 dot products (layers.matmul.WidenedCpuMatmul)."""

    def product(self, weight):
        return WidenedCpuMatmul(weight)

    def describe(self) -> str:
        return (f"torch bfloat16 below {WidenedCpuMatmul.WIDEN_ROWS} rows, oneDNN float32 on widened weights from "
                f"{WidenedCpuMatmul.WIDEN_ROWS} (no bf16 dot products)")


@dataclass
class DensePanels(MatmulKernel):
    """meshserve's C++ product on weights in panels (layers.matmul.DenseCpuMatmul). It counts
    the weights it prepared and how many of those it keeps in bf16 (a float32 weight of bf16
    numbers, layers.matmul.bf16_exact)."""

    library: CpuLibrary
    dtype: torch.dtype
    prepared: int = 0
    kept_in_bf16: int = 0

    def product(self, weight):
        return DenseCpuMatmul(weight, self.library)

    def prepare(self, weight):
        dense = self.product(weight)
        self.prepared += 1
        self.kept_in_bf16 += dense.weight.dtype != dense.dtype
        return dense

    @property
    def all_kept_in_bf16(self) -> bool:
        return 0 < self.kept_in_bf16 == self.prepared

    def describe(self) -> str:
        kept = " kept in bf16 (bf16 numbers, widened exactly)" if self.all_kept_in_bf16 else ""
        return f"C++ {DENSE_ISAS[self.library.isa]} on {_name(self.dtype)} weights in panels{kept}"


@dataclass
class AmxTiles(MatmulKernel):
    """meshserve's AMX product (layers.matmul.AmxCpuMatmul); a weight whose in-features are
    not a multiple of its tile row takes oneDNN's packed product. `float_out` (the LM head):
    the float32 sums are the logits; rounded to bf16, logits a few hundredths apart become
    equal and greedy decoding picks between ties (SmolLM2's answer to "What is the capital
    of France?" then starts with another word than float32's)."""

    library: CpuLibrary
    float_out: bool = False

    def product(self, weight):
        if weight.shape[1] % AmxCpuMatmul.STEP_K:
            return PackedCpuMatmul(weight)
        return AmxCpuMatmul(weight, self.library, self.float_out)

    def silu_mul_product(self, weight):
        if weight.shape[1] % AmxCpuMatmul.STEP_K or weight.shape[0] % AmxCpuMatmul.SILU_ROWS or self.float_out:
            return None
        return AmxCpuMatmul(weight, self.library, silu_mul=True)

    def describe(self) -> str:
        return "C++ AMX tiles on bfloat16 weights" + (", float32 out" if self.float_out else "")


def _inputs(act_dtype: torch.dtype) -> str:
    """How a float32 model's weight-only kernels take their inputs (layers.quant.kernel_dtype)."""
    kernel = kernel_dtype(act_dtype)
    return "" if kernel == act_dtype else f" on {_name(kernel)} inputs"


@dataclass
class Int4Groups(MatmulKernel):
    act_dtype: torch.dtype

    def product(self, weight):
        return Int4Matmul(weight, self.act_dtype)

    def describe(self) -> str:
        return f"int4 groups (torch's _weight_int4pack_mm){_inputs(self.act_dtype)}"


@dataclass
class Int8Weights(MatmulKernel):
    """int8 weights; `int8_inputs`: the inputs quantized to int8 per row too (torch._int_mm)."""

    act_dtype: torch.dtype
    int8_inputs: bool = False

    def product(self, weight):
        return (Int8DynamicMatmul if self.int8_inputs else Int8Matmul)(weight, self.act_dtype)

    def describe(self) -> str:
        if self.int8_inputs:
            return "int8 weights times int8 rows (torch's _int_mm)"
        return f"int8 weights (torch's _weight_int8pack_mm){_inputs(self.act_dtype)}"


@dataclass
class W8A8Rows(MatmulKernel):
    library: CpuLibrary | None

    def product(self, weight):
        return W8A8Matmul(weight, self.library)

    def describe(self) -> str:
        if amx_int8_runs(self.library):
            return "AMX int8 tiles on 8-bit rows (oneDNN u8 x s8 where the inputs are not a multiple of 64)"
        return "oneDNN u8 x s8 (VNNI) on 8-bit rows"


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies packed `dtype` weights on this CPU."""
    return torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def unquantized_kernel(device: torch.device | str, dtype: torch.dtype, library: CpuLibrary | None) -> MatmulKernel:
    """The product of unquantized `dtype` weights on `device` (this module's docstring)."""
    if torch.device(device).type != "cpu":
        return StoredWeight(dtype)
    features = cpu_features()
    if library is not None and library.isa == "avx512" and dtype == torch.bfloat16 and features.amx_bf16:
        return AmxTiles(library)
    bf16_compute = features.bf16_compute
    if library is not None and library.isa in DENSE_ISAS and (
            dtype == torch.float32 or (dtype == torch.bfloat16 and not bf16_compute)):
        return DensePanels(library, dtype)
    if onednn_packs(dtype):
        return OneDnnPacked(dtype)
    if dtype == torch.bfloat16 and not bf16_compute:
        return WidenedBf16()
    return StoredWeight(dtype)


def quantized_kernel(quantization: Quantization, act_dtype: torch.dtype, library: CpuLibrary | None, *,
                     int8_inputs: bool = False) -> MatmulKernel:
    """The product of `quantization` weights for activations in `act_dtype`. `int8_inputs`:
    int8 weights multiply int8-quantized inputs unless the activations are float32 or the
    CPU has no int8 dot product (there `_int_mm` is slower than the weight-only kernel)."""
    if quantization is Quantization.INT4:
        return Int4Groups(act_dtype)
    if quantization is Quantization.INT8:
        return Int8Weights(act_dtype, int8_inputs and act_dtype != torch.float32 and cpu_features().vnni)
    if quantization is Quantization.W8A8:
        return W8A8Rows(library)
    raise ValueError(f"no quantized product for model.quantization={quantization}")


@dataclass
class MatmulPlan:
    """The products of one rank's model, chosen once (`plan_matmuls`) and read by the
    loader (it prepares every weight), the start-up line and the MFU/MBU cost."""

    quantization: Quantization
    load_dtype: torch.dtype
    """The weights' dtype while they are prepared: float32 for a quantized model (a Q4_1
    GGUF's codes survive exactly), else the model's."""
    linear: MatmulKernel
    """The decoder layers' linears (and experts)."""
    head: MatmulKernel
    """The LM head: int8 when the layers take int4 (Quantization.head), int8 inputs too."""
    router: MatmulKernel
    """The MoE routers, never quantized (a coarser router sends tokens to other experts)."""
    library: CpuLibrary | None

    def describe(self) -> str:
        """What multiplies, e.g. `int4 groups (torch's _weight_int4pack_mm), the head int8
        weights times int8 rows (torch's _int_mm)`."""
        linear, head = self.linear.describe(), self.head.describe()
        return linear if head == linear else f"{linear}, the head {head}"

    def dense_kernels(self) -> list[DensePanels]:
        return [k for k in {id(k): k for k in (self.linear, self.head, self.router)}.values()
                if isinstance(k, DensePanels)]

    def kept_in_bf16(self) -> tuple[int, int]:
        """(how many of the C++ products keep a float32 weight in bf16, how many run)."""
        dense = self.dense_kernels()
        return sum(k.kept_in_bf16 for k in dense), sum(k.prepared for k in dense)


def plan_matmuls(device: torch.device | str, dtype: torch.dtype, quantization: Quantization = Quantization.NONE,
                 library: CpuLibrary | None = None) -> MatmulPlan:
    """The products of a model in `dtype` with `quantization` on `device`, with `library` (the
    loaded C++ kernels, None where they did not build or off the CPU)."""
    quantization = Quantization(quantization)
    if quantization.quantized and torch.device(device).type != "cpu":
        raise ValueError(f"model.quantization={quantization} is a CPU path; the model is on {device}")
    load_dtype = torch.float32 if quantization.quantized else dtype
    plain = unquantized_kernel(device, load_dtype, library)
    if not quantization.quantized:
        head = AmxTiles(library, float_out=True) if isinstance(plain, AmxTiles) else plain
        return MatmulPlan(quantization, load_dtype, plain, head, plain, library)
    return MatmulPlan(quantization, load_dtype, quantized_kernel(quantization, dtype, library),
                      quantized_kernel(quantization.head, dtype, library, int8_inputs=True), plain, library)
