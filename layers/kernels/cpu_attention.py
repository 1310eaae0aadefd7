"""meshserve's C++ paged decode attention for the CPU (cpu_decode_attention.cpp), built with
torch's extension builder the first time a process needs it and cached on disk by torch.

The torch backend's decode path otherwise gathers every sequence's blocks into a padded
copy and calls SDPA with a mask: at 32 sequences of ~160 cached tokens that was 13-14 of a
35 ms decode step on SmolLM2 (bf16, compiled; measured by replacing attention with a
no-op). This kernel reads the keys and values in place through the block table.

`available()` builds (or loads) the library once and says whether it worked: without a C++
compiler the torch backend keeps its gather + SDPA path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")

ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
"""Compiler flags per instruction set torch detected on this CPU; the library's name
carries the set, so a cache shared by different machines never loads a wrong build."""


@functools.cache
def available() -> bool:
    """Builds and loads the kernel library (once per process); False if that fails."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    # NOTE: -fopenmp: at::parallel_for is inline OpenMP; without it the kernel runs on one
    # thread. The OpenMP runtime is torch's own, already loaded (nothing more is linked).
    try:
        cpp_extension.load(name=f"meshserve_cpu_kernels_{capability.lower()}", sources=[str(SOURCE)],
                           extra_cflags=["-O3", "-ffast-math", "-fopenmp", *ISA_FLAGS.get(capability, [])],
                           is_python_module=False)
    except (OSError, RuntimeError) as e:
        log.warning("could not build meshserve's C++ decode attention (%s); decode attention gathers the "
                    "cache and calls SDPA instead", e)
        return False
    torch.library.register_fake("meshserve_cpu::paged_decode_attention")(_paged_decode_attention_shape)
    return True


def _paged_decode_attention_shape(q, k_cache, v_cache, block_tables, seq_lens, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, heads, head_dim), one token per sequence; the caches (blocks, block_size,
    kv_heads, head_dim); block_tables (n, width) and seq_lens (n,) int64 -> (n, heads,
    head_dim), softmax over each sequence's first seq_lens cached tokens. Needs available()."""
    return torch.ops.meshserve_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
