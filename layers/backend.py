"""Kernel backends: what computes paged attention, RMSNorm, rotary and SwiGLU's
activation on this rank.

The model gets one backend object when it is built and calls it; the model code never
branches on the device, and a backend's attention reads only the metadata type that
backend builds for a step (`build_metadata`), so each backend's step inputs cost only
what it reads:
- `TorchBackend`: plain torch ops (SDPA, CPU flash attention with LSE), its metadata
  `layers.attention.AttentionMetadata`: the reference every other backend is tested
  against, and the default on CPU without a C++ compiler. No C++ inside.
- `CpuBackend` (meshserve.layers.cpu_backend): the torch backend with
  meshserve's C++ kernels where they are faster; its metadata `CpuMetadata`. The default
  on CPU when the kernels build. It holds the loaded build it calls (`library`).
- `TritonBackend` (meshserve.layers.triton_backend): meshserve's Triton kernels,
  its metadata `TritonMetadata`; the default on CUDA when triton is installed
  (`pip install 'meshserve[gpu]'`).
- `ContextParallelBackend`: any of those with a context-parallel group: its metadata is
  meshserve.parallel.context_attention's, its attention the ring / merge over the group
  computed with the wrapped backend's LSE attentions.

`select_backend` maps the config's `device.kernels` (auto | torch | triton | cpu) to a
backend. `kernel_summary` is the start-up line: what the chosen backend and the model's
matmul plan (layers.matmul_plan) say about themselves.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from meshserve.comm.groups import AxisGroup
from meshserve.layers import activation, attention, norm, rotary
from meshserve.layers.kernels import triton_available
from meshserve.layers.kernels.cpu_library import CpuLibrary
from meshserve.layers.matmul_plan import MatmulPlan
from meshserve.parallel import context_attention, ring_attention

log = logging.getLogger(__name__)

BACKENDS = ("torch", "triton", "cpu")


class StepMetadata(Protocol):
    """A step's attention metadata, shared by every layer: built by one backend's
    `build_metadata` (AttentionMetadata, CpuMetadata, TritonMetadata, or
    ContextParallelMetadata) and read only by that backend's `attention`."""

    slot_mapping: torch.Tensor
    """The cache slot of each token whose K/V this rank stores."""


class Backend:
    """The interface. Shapes: q (num_tokens, heads, head_dim); k, v (num_tokens,
    kv_heads, head_dim); the KV cache of a layer (k_cache, v_cache), each (num_blocks,
    block_size, kv_heads, head_dim), or int8 (..., head_dim + 4) with cache.dtype=int8
    (meshserve.layers.kv_quant; the torch and cpu backends). LSE: natural log, float32, (num_queries, heads), -inf
    for a query that sees no key (its out is 0)."""

    name = "base"
    library: CpuLibrary | None = None
    """The loaded C++ CPU kernels this backend calls (the cpu backend's); None for the others."""

    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int, device: torch.device | str = "cpu") -> StepMetadata:
        """Host lists of a step (new tokens, tokens in the cache after the step, and the
        block ids of each sequence) -> this backend's attention metadata."""
        raise NotImplementedError

    def attention(self, q, k, v, kv_cache, meta: StepMetadata, scale: float) -> torch.Tensor:
        """Stores the new K/V in the cache, then returns softmax(q k^T scale) v for every
        new token over its sequence's cached tokens (causal within a chunk)."""
        raise NotImplementedError

    def cp_decode_lse(self, q, k_cache, v_cache, meta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Context parallelism: the replicated decode queries (num_decodes, heads, head_dim)
        over this rank's share of their sequences (a ContextParallelMetadata). Returns out
        float32 and lse, for the merge over the group."""
        raise NotImplementedError

    def attention_lse(self, q, k, v, scale: float, q_pos=None, k_pos=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Context parallelism: q (T, heads, D) over one contiguous block of keys k, v
        (L, kv_heads, D): every key, or query i sees key j iff q_pos[i] >= k_pos[j]
        (tensors). Returns out (T, heads, D) float32 and lse (T, heads)."""
        raise NotImplementedError

    def rms_norm(self, x, weight, eps: float, residual=None):
        """norm(x), or with `residual` (norm(x + residual), x + residual)."""
        raise NotImplementedError

    def rotary(self, rope: tuple[torch.Tensor, torch.Tensor], q, k) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k rotated by rope = (cos, sin), each (num_tokens, 1, head_dim); may work in place."""
        raise NotImplementedError

    def rotary_attention(self, rope: tuple[torch.Tensor, torch.Tensor], q, k, v, kv_cache, meta: StepMetadata,
                         scale: float) -> torch.Tensor:
        """`attention` of q, k rotated by `rope` (as `rotary`), and v; a backend may fuse the
        rotation with the cache writes (the Triton backend does)."""
        q, k = self.rotary(rope, q, k)
        return self.attention(q, k, v, kv_cache, meta, scale)

    silu_and_mul = staticmethod(activation.silu_and_mul)
    """x (num_tokens, 2n) = [gate, up] -> silu(gate) * up."""

    fused_moe = None
    """A MoE layer's experts in one fused kernel, fused_moe(x, w13, w2, topk_ids,
    topk_weights) (layers/kernels/fused_moe.py); None: layers.moe groups the tokens by
    expert and multiplies each expert's in one matmul."""

    def summary(self, head_dim: int, dtype: torch.dtype = torch.float32) -> str:
        """What computes attention and the norms of a `dtype` model, for the start-up line
        (kernel_summary)."""
        return f"attention, norm/act: {self.name} backend"


class TorchBackend(Backend):
    """Plain torch: the reference implementations, called directly (no wrapper per call)."""

    name = "torch"

    def __init__(self):
        self.workspace = attention.GatherWorkspace()

    def build_metadata(self, query_lens, seq_lens, block_tables, block_size, device="cpu"):
        return attention.build_attention_metadata(query_lens, seq_lens, block_tables, block_size, device,
                                                  self.workspace)

    attention = staticmethod(attention.paged_attention)
    cp_decode_lse = staticmethod(context_attention.decode_lse)
    attention_lse = staticmethod(ring_attention.flash_part)
    rms_norm = staticmethod(norm.rms_norm)
    rotary = staticmethod(rotary.RotaryEmbedding.apply)


class ContextParallelBackend(Backend):
    """`inner`'s kernels with a sequence's tokens split over the context-parallel group
    `cp`: the step's metadata is a ContextParallelMetadata (the model runner builds it
    from each sequence's share, parallel.context_attention.build_cp_metadata), attention
    exchanges K/V blocks and partial outputs over `cp` and computes each part with
    `inner`'s LSE attentions; norms and rotary are `inner`'s."""

    def __init__(self, inner: Backend, cp: AxisGroup):
        self.inner, self.cp = inner, cp
        self.name = inner.name
        self.rms_norm, self.rotary, self.silu_and_mul = inner.rms_norm, inner.rotary, inner.silu_and_mul
        self.fused_moe, self.library = inner.fused_moe, inner.library

    def attention(self, q, k, v, kv_cache, meta: context_attention.ContextParallelMetadata, scale: float):
        return context_attention.cp_attention(q, k, v, kv_cache, meta, self.cp, scale, self.inner)

    def summary(self, head_dim: int, dtype: torch.dtype = torch.float32) -> str:
        return self.inner.summary(head_dim, dtype)


def resolve_backend_name(name: str, device: torch.device | str, library: CpuLibrary | None = None) -> str:
    """`auto`: triton on CUDA when it is installed, else torch; cpu on the CPU when its
    C++ kernels built (`library`, cpu_library.load of config device.cpu_isa), else torch."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown kernel backend {name!r} (auto, {', '.join(BACKENDS)})")
    if name != "auto":
        return name
    if torch.device(device).type != "cuda":
        return "cpu" if library is not None else "torch"
    if triton_available():
        return "triton"
    log.warning("device.kernels=auto on CUDA without triton: using the torch backend "
                "(pip install 'meshserve[gpu]' for meshserve's Triton kernels)")
    return "torch"


def select_backend(name: str = "auto", device: torch.device | str = "cpu", library: CpuLibrary | None = None
                   ) -> Backend:
    """The backend for config value `name` (auto | torch | triton | cpu) on `device`; the cpu
    backend calls `library` (a build of the C++ CPU kernels, cpu_library.load)."""
    resolved = resolve_backend_name(name, device, library)
    if resolved == "torch":
        return TorchBackend()
    if resolved == "cpu":
        if torch.device(device).type != "cpu" or library is None:
            raise RuntimeError(f"device.kernels=cpu needs the CPU and a C++ compiler for its kernel (device {device})")
        from meshserve.layers.cpu_backend import CpuBackend

        return CpuBackend(library)
    if not triton_available():
        raise ImportError("device.kernels=triton needs triton: pip install 'meshserve[gpu]'")
    from meshserve.layers.triton_backend import TritonBackend

    return TritonBackend()


def kernel_summary(backend: Backend, matmuls: MatmulPlan, head_dim: int, dtype: torch.dtype = torch.float32) -> str:
    """One start-up line: what computes each op of this rank's model, as the chosen objects
    describe themselves, e.g. `matmul: C++ AVX2 on float32 weights in panels; attention: cpu
    backend, C++ paged decode (avx2 build), prefill SDPA; norm/act/rotary: C++ (avx2 build)
    in eager steps`."""
    return f"matmul: {matmuls.describe()}; {backend.summary(head_dim, dtype)}"
