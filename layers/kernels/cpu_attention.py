"""meshserve's C++ paged decode attention for the CPU (cpu_decode_attention.cpp).

The torch backend's decode path otherwise gathers every sequence's blocks into a padded
copy and calls SDPA with a mask: at 32 sequences of ~160 cached tokens that was 13-14 of a
35 ms decode step on SmolLM2 (bf16, compiled; measured by replacing attention with a
no-op). This kernel reads the keys and values in place through the block table.

`available()` (cpu_library.py) builds the library once and says whether it worked: without
a C++ compiler the torch backend keeps its gather + SDPA path.
"""

from __future__ import annotations

import torch

from meshserve.layers.kernels.cpu_library import available

__all__ = ["available", "paged_decode_attention"]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, heads, head_dim), one token per sequence; the caches (blocks, block_size,
    kv_heads, head_dim); block_tables (n, width) and seq_lens (n,) int64 -> (n, heads,
    head_dim), softmax over each sequence's first seq_lens cached tokens. Needs available()."""
    return torch.ops.meshserve_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
