"""meshserve's C++ attention for the CPU: paged decode (cpu_decode_attention.cpp) and the
causal attention of prefill chunks with no cached prefix (cpu_prefill_attention.cpp; in
bf16 on AMX tiles where the CPU has them, cpu_amx_attention.cpp).

The torch backend's decode path otherwise gathers every sequence's blocks into a padded
copy and calls SDPA with a mask, a large share of a decode step at many sequences (measured
by replacing attention with a no-op). This kernel reads the keys and values in place
through the block table.

Each wrapper takes the loaded build it calls (`cpu_library.load`): without a C++ compiler
there is none, and the torch backend keeps its gather + SDPA path.
"""

from __future__ import annotations

import torch

from meshserve.configs.cpu_features import cpu_features
from meshserve.layers.kernels.cpu_library import CpuLibrary

__all__ = ["amx_prefill_runs", "paged_decode_attention", "prefill_attention", "prefill_fits"]

PREFILL_HEAD_DIMS = (64, 128)
"""Head sizes the prefill kernel has a vector path for; others keep torch's SDPA."""


def paged_decode_attention(library: CpuLibrary, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           skip: torch.Tensor | None = None) -> torch.Tensor:
    """q (n, heads, head_dim), one token per sequence; the caches (blocks, block_size,
    kv_heads, head_dim); block_tables (n, width) and seq_lens (n,) int64 -> (n, heads,
    head_dim), softmax over each sequence's first seq_lens cached tokens but those `skip`
    names ((n,) int64: bit j, the key at position seq_len - 1 - j; a draft tree's rows)."""
    if skip is None:
        return library.ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return library.ops.paged_tree_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, skip)


def prefill_fits(library: CpuLibrary, head_dim: int) -> bool:
    """Whether prefill_attention beats torch's SDPA here: the AVX-512 build and a head size
    of its vector path (measured on SmolLM2's heads, bf16, short and long prompts)."""
    return head_dim in PREFILL_HEAD_DIMS and library.isa == "avx512"


def prefill_attention(library: CpuLibrary, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q (tokens, heads, head_dim), k and v (tokens, kv_heads, head_dim), the flat batch of
    a step; chunks (n, 2) int64, each chunk's first row and length -> (tokens, heads,
    head_dim) where each chunk's rows hold causal softmax attention over the chunk's own
    keys (other rows are left unset). bf16 on AMX tiles where amx_prefill_runs."""
    if amx_prefill_runs(library, q.dtype, q.shape[-1]):
        return library.ops.amx_prefill_attention(q, k, v, chunks, scale)
    return library.ops.prefill_attention(q, k, v, chunks, scale)


def amx_prefill_runs(library: CpuLibrary, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prefill_attention takes the AMX kernel: bf16, head sizes a multiple of 64 (up
    to 256), the avx512 build on a CPU with AMX-BF16."""
    return (dtype == torch.bfloat16 and head_dim % 64 == 0 and head_dim <= 256 and library.isa == "avx512"
            and cpu_features().amx_bf16)
