"""meshserve's C++ attention for the CPU: paged decode (cpu_decode_attention.cpp) and the
causal attention of prefill chunks with no cached prefix (cpu_prefill_attention.cpp).

The torch backend's decode path otherwise gathers every sequence's blocks into a padded
copy and calls SDPA with a mask: at 32 sequences of ~160 cached tokens that was 13-14 of a
35 ms decode step on SmolLM2 (bf16, compiled; measured by replacing attention with a
no-op). This kernel reads the keys and values in place through the block table.

`available()` (cpu_library.py) builds the library once and says whether it worked: without
a C++ compiler the torch backend keeps its gather + SDPA path.
"""

from __future__ import annotations

import torch

from meshserve.layers.kernels import cpu_library
from meshserve.layers.kernels.cpu_library import available

__all__ = ["available", "paged_decode_attention", "prefill_attention", "prefill_fits"]

PREFILL_HEAD_DIMS = (64, 128)
"""Head sizes the prefill kernel has a vector path for; others keep torch's SDPA."""


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, heads, head_dim), one token per sequence; the caches (blocks, block_size,
    kv_heads, head_dim); block_tables (n, width) and seq_lens (n,) int64 -> (n, heads,
    head_dim), softmax over each sequence's first seq_lens cached tokens. Needs available()."""
    return cpu_library.ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def prefill_fits(head_dim: int) -> bool:
    """Whether prefill_attention beats torch's SDPA here: the AVX-512 build selected and a
    head size of its vector path (16 prompts of 128 tokens, SmolLM2's heads, bf16: 1.5 vs
    4.4 ms per layer; one of 2,048 tokens: 27 vs 36 ms)."""
    return head_dim in PREFILL_HEAD_DIMS and available() and cpu_library.selected_isa == "avx512"


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q (tokens, heads, head_dim), k and v (tokens, kv_heads, head_dim), the flat batch of
    a step; chunks (n, 2) int64, each chunk's first row and length -> (tokens, heads,
    head_dim) where each chunk's rows hold causal softmax attention over the chunk's own
    keys (other rows are left unset). Needs available()."""
    return cpu_library.ops.prefill_attention(q, k, v, chunks, scale)
