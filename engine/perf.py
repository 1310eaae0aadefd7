"""The machine's roofline, measured, and the model's cost per step: the figures behind
MFU (model FLOPs/s over matmul peak) and MBU (bytes read/s over memory bandwidth)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from meshserve.configs.memory import kv_row_bytes, matmul_bytes_per_param
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.quantization import Quantization
from meshserve.layers.kernels.cpu_library import CpuLibrary
from meshserve.layers.matmul import PackedCpuMatmul
from meshserve.layers.matmul_plan import AmxTiles, DensePanels, onednn_packs, plan_matmuls


def _best_of(fn, repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_memory_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s read by a sum over a buffer far larger than the caches: what a decode step
    does with the weights (reads them, writes little). A copy would count the writes and,
    on CPUs, the reads-for-ownership of the destination that it does not report."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def run():
        src.sum()
        if device != "cpu":
            torch.cuda.synchronize()

    return nbytes / _best_of(run, repeats)


def measure_matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5, device: str = "cpu",
                        quantization: Quantization = Quantization.NONE, library: CpuLibrary | None = None) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`: on CPU, of the product the model's linears
    run for this dtype, `quantization` and `library` (the C++ kernels the model calls; the
    kernel of layers.matmul_plan: meshserve's panels, oneDNN's packed product, bf16 widened
    to float32 on a CPU without bf16 dot products, the quantized kernels; torch.mm where
    none applies), so MFU is against the kernels the config runs and not a dtype the CPU
    cannot compute fast."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    kernel = plan_matmuls(device, dtype, quantization, library).linear if device == "cpu" else None
    prepared = kernel.product(b.t().contiguous()) if kernel is not None else None
    if prepared is not None:
        # NOTE: not torch.mm as well: in bf16 on a CPU without bf16 dot products it is so slow
        # that timing it alone would lengthen every bf16 start by seconds
        best = _best_of(lambda: prepared(a), repeats)
        if isinstance(kernel, (DensePanels, AmxTiles)) and onednn_packs(dtype):
            # meshserve's kernel is tuned to decoders' widths: at this n oneDNN's packed
            # product is the machine's peak
            packed = PackedCpuMatmul(b.t().contiguous())
            best = min(best, _best_of(lambda: packed(a), repeats))
        return 2 * n ** 3 / best

    def run():
        torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()

    return 2 * n ** 3 / _best_of(run, repeats)


@dataclass(frozen=True)
class ModelCost:
    """Per-token and per-step costs of a dense decoder, for one full (unsharded) model."""

    info: ModelInfo
    dtype_bytes: int
    quantization: Quantization = Quantization.NONE
    """Weight-only quantization of the linear layers (Quantization.head for the head)."""
    kv_dtype: str = "auto"
    """config cache.dtype (auto: the activations' dtype, or int8)."""
    weight_dtype_bytes: int | None = None
    """Bytes of an unquantized weight as the products read it, where that is not the
    activations' dtype (a float32 model's bf16 numbers kept in bf16: layers/matmul.py
    bf16_exact); None: dtype_bytes."""

    @property
    def matmul_params(self) -> int:
        """Parameters used as matmul weights per token: every linear plus the LM head
        (the embedding lookup reads one row, not the matrix); of a mixture of experts, only
        the experts a token is routed to (its active parameters)."""
        i = self.info
        return i.num_active_parameters - (0 if i.tie_word_embeddings else i.vocab_size * i.hidden_size)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read by a decode step of one token (of a mixture of experts, its
        active experts: a batch reads more of them, up to all)."""
        i = self.info
        head = i.vocab_size * i.hidden_size
        layers = i.num_hidden_layers * i.active_layer_parameters + i.hidden_size  # and the final norm
        stored = self.weight_dtype_bytes or self.dtype_bytes
        return int(layers * matmul_bytes_per_param(self.quantization, stored)
                   + head * matmul_bytes_per_param(Quantization(self.quantization).head, stored))

    @property
    def kv_bytes_per_token(self) -> int:
        i = self.info
        return 2 * i.num_hidden_layers * i.num_key_value_heads * kv_row_bytes(i.head_dim, self.kv_dtype,
                                                                              self.dtype_bytes)

    def flops(self, num_new_tokens: int, context_len: int) -> float:
        """FLOPs of one sequence computing `num_new_tokens` tokens ending at `context_len`
        (2 per multiply-add; attention scores and values over the causal context)."""
        i = self.info
        dense = 2 * self.matmul_params * num_new_tokens
        # sum over new tokens of the context each attends to, times QK^T and PV (2 x 2 flops per head dim)
        start = context_len - num_new_tokens
        attended = num_new_tokens * (start + context_len + 1) / 2
        attention = 4 * i.num_hidden_layers * i.num_attention_heads * i.head_dim * attended
        return dense + attention
