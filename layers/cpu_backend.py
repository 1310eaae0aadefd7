"""The cpu backend: the torch backend with meshserve's C++ kernels where they are faster.

Decode attention runs in the C++ kernel that reads the paged cache (bf16, float32 or
int8) in place through the block table, so its metadata carries each decode's cached
length instead of the torch backend's mask; the prefill chunks with no cached prefix run
in one call of the C++ causal kernel (their spans in the metadata) where it beats SDPA
(`cpu_attention.prefill_fits`), the chunks after a cached prefix in the torch path. The
int8 cache's rows are quantized in C++, and RMSNorm, silu-and-mul and rotary are one C++
pass each outside compiled graphs (faster than the torch ops they replace on prefill rows).
The context-parallel LSE attentions are the torch backend's.

The backend holds the loaded build of the kernels (`CpuLibrary`) it calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.layers import activation, attention, norm, rotary
from meshserve.layers.attention import PagedMetadata
from meshserve.layers.backend import TorchBackend
from meshserve.layers.kernels import cpu_attention
from meshserve.layers.kernels.cpu_library import CpuLibrary


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


def cpu_paged_attention(library: CpuLibrary, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: CpuMetadata, scale: float) -> torch.Tensor:
    """Stores the new K/V (int8 rows quantized in C++), then attends: decodes in the C++
    paged kernel, fresh chunks in the C++ prefill kernel where it fits, the rest as the
    torch backend does."""
    k_cache, v_cache = kv_cache
    if k_cache.dtype == k.dtype and not torch.compiler.is_compiling() and _heads_contiguous(k, v):
        library.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        attention.store_kv(kv_cache, k, v, meta.slot_mapping, quantize=library.ops.quantize_kv_int8)
    if meta.decode_only:  # every row decodes, in order
        return cpu_attention.paged_decode_attention(library, q, k_cache, v_cache, meta.decode_block_tables,
                                                    meta.decode_lens, scale, meta.decode_skip)
    fused = meta.fresh_chunks is not None and cpu_attention.prefill_fits(library, q.shape[-1])
    out = cpu_attention.prefill_attention(library, q, k, v, meta.fresh_chunks, scale) if fused else torch.empty_like(q)
    if meta.decode_rows is not None:
        out[meta.decode_rows] = cpu_attention.paged_decode_attention(
            library, q[meta.decode_rows], k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, scale,
            meta.decode_skip)
    for chunk in meta.prefills:
        if not (fused and chunk.fresh):
            attention.prefill_chunk(q, k, v, kv_cache, chunk, scale, out)
    return out


def _heads_contiguous(*rows: torch.Tensor) -> bool:
    """Whether each token's heads of (tokens, heads, head_dim) rows are one contiguous run."""
    return all(r.stride(2) == 1 and r.stride(1) == r.shape[2] for r in rows)


class CpuBackend(TorchBackend):
    """The torch backend with the C++ kernels of this module's docstring, from `library`."""

    name = "cpu"

    def __init__(self, library: CpuLibrary):
        super().__init__()
        self.library = library
        self.ops = library.ops

    def build_metadata(self, query_lens, seq_lens, block_tables, block_size, device="cpu"):
        return build_cpu_metadata(query_lens, seq_lens, block_tables, block_size, device)

    def attention(self, q, k, v, kv_cache, meta: CpuMetadata, scale: float) -> torch.Tensor:
        return cpu_paged_attention(self.library, q, k, v, kv_cache, meta, scale)

    def rms_norm(self, x, weight, eps: float, residual=None):
        if torch.compiler.is_compiling() or x.dim() != 2 or not x.is_contiguous():
            return norm.rms_norm(x, weight, eps, residual)
        out, total = self.ops.rms_norm(x, weight, eps, residual)
        return out if residual is None else (out, total)

    def rotary(self, rope, q, k):
        if torch.compiler.is_compiling() or q.stride(-1) != 1 or k.stride(-1) != 1:
            return rotary.RotaryEmbedding.apply(rope, q, k)
        return self.ops.rotary(q, k, *rope)

    def silu_and_mul(self, x):
        if torch.compiler.is_compiling() or x.dim() != 2 or not x.is_contiguous():
            return activation.silu_and_mul(x)
        return self.ops.silu_and_mul(x)

    def summary(self, head_dim: int, dtype: torch.dtype = torch.float32) -> str:
        build = f"{self.library.isa} build"
        prefill = f"C++ causal ({build})" if cpu_attention.prefill_fits(self.library, head_dim) else "SDPA"
        if cpu_attention.amx_prefill_runs(self.library, dtype, head_dim):
            prefill = f"C++ causal on AMX tiles ({build})"
        return (f"attention: cpu backend, C++ paged decode ({build}), prefill {prefill}; "
                f"norm/act/rotary: C++ ({build}) in eager steps")
