"""The cpu backend: the torch backend with meshserve's C++ kernels where they are faster.

Decode attention runs in the C++ kernel that reads the paged cache (bf16, float32 or
int8) in place through the block table, so its metadata carries each decode's cached
length instead of the torch backend's mask; the prefill chunks with no cached prefix run
in one call of the C++ causal kernel (their spans in the metadata) where it beats SDPA
(`cpu_attention.prefill_fits`), the chunks after a cached prefix in the torch path. The
int8 cache's rows are quantized in C++, and RMSNorm, silu-and-mul and rotary are one C++
pass each outside compiled graphs: 0.14 vs 0.41 ms and 0.55 vs 0.85 ms on SmolLM2's 2048-token
prefill rows (bf16, 2 cores). The context-parallel LSE attentions are the torch backend's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.layers import activation, attention, kv_quant, norm, rotary
from meshserve.layers.attention import PagedMetadata
from meshserve.layers.backend import TorchBackend
from meshserve.layers.kernels import cpu_attention, cpu_library


@dataclass
class CpuMetadata(PagedMetadata):
    """The cpu backend's metadata."""

    decode_lens: torch.Tensor | None = None
    """(num_decodes,) int64 cached tokens of each decode, which the C++ kernel reads up to."""
    fresh_chunks: torch.Tensor | None = None
    """(n, 2) int64 first row and length of each prefill chunk with no cached prefix, for
    the C++ prefill kernel (None when the step has none)."""

    def dynamic_tensors(self) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, int]]]:
        batch, width = super().dynamic_tensors()
        return batch + [self.decode_lens], width


def build_cpu_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                       device: torch.device | str = "cpu") -> CpuMetadata:
    meta, lens = attention.build_paged_metadata(CpuMetadata, query_lens, seq_lens, block_tables, block_size, device)
    meta.decode_lens = lens
    fresh = [[c.start, c.query_len] for c in meta.prefills if c.fresh]
    if fresh:
        meta.fresh_chunks = torch.tensor(fresh, dtype=torch.long, device=device)
    return meta


def cpu_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                        meta: CpuMetadata, scale: float) -> torch.Tensor:
    """Stores the new K/V (int8 rows quantized in C++), then attends: decodes in the C++
    paged kernel, fresh chunks in the C++ prefill kernel where it fits, the rest as the
    torch backend does."""
    attention.store_kv(kv_cache, k, v, meta.slot_mapping, quantize=kv_quant.quantize_native)
    k_cache, v_cache = kv_cache
    if meta.decode_only:  # every row decodes, in order
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens,
                                                    scale)
    fused = meta.fresh_chunks is not None and cpu_attention.prefill_fits(q.shape[-1])
    out = cpu_attention.prefill_attention(q, k, v, meta.fresh_chunks, scale) if fused else torch.empty_like(q)
    if meta.decode_rows is not None:
        out[meta.decode_rows] = cpu_attention.paged_decode_attention(
            q[meta.decode_rows], k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, scale)
    for chunk in meta.prefills:
        if not (fused and chunk.fresh):
            attention.prefill_chunk(q, k, v, kv_cache, chunk, scale, out)
    return out


class CpuBackend(TorchBackend):
    """The torch backend with the C++ kernels of this module's docstring."""

    name = "cpu"

    def build_metadata(self, query_lens, seq_lens, block_tables, block_size, device="cpu"):
        return build_cpu_metadata(query_lens, seq_lens, block_tables, block_size, device)

    attention = staticmethod(cpu_paged_attention)

    @staticmethod
    def rms_norm(x, weight, eps: float, residual=None):
        if torch.compiler.is_compiling() or x.dim() != 2 or not x.is_contiguous():
            return norm.rms_norm(x, weight, eps, residual)
        out, total = cpu_library.ops.rms_norm(x, weight, eps, residual)
        return out if residual is None else (out, total)

    @staticmethod
    def rotary(rope, q, k):
        if torch.compiler.is_compiling() or q.stride(-1) != 1 or k.stride(-1) != 1:
            return rotary.RotaryEmbedding.apply(rope, q, k)
        return cpu_library.ops.rotary(q, k, *rope)

    @staticmethod
    def silu_and_mul(x):
        if torch.compiler.is_compiling() or x.dim() != 2 or not x.is_contiguous():
            return activation.silu_and_mul(x)
        return cpu_library.ops.silu_and_mul(x)

    def summary(self, head_dim: int) -> str:
        build = f"{cpu_library.selected_isa} build"
        prefill = f"C++ causal ({build})" if cpu_attention.prefill_fits(head_dim) else "SDPA"
        return (f"attention: cpu backend, C++ paged decode ({build}), prefill {prefill}; "
                f"norm/act/rotary: C++ ({build}) in eager steps")
