"""Host memory for the big CPU tensors (the KV cache, the packed weights): anonymous private
maps, in transparent huge pages where the kernel gives them (`madvise` mode included).

torch.zeros writes every byte: a 1 GiB KV cache took seconds of a start, all of it resident
though a short run writes a few blocks. `zeros_on_touch` maps memory the kernel hands out
zeroed on first touch instead; pages never written take no memory.

A 538 MB stream of weights in 4 KB pages misses the TLB every page: in 2 MB pages the same
products read SmolLM2's weights ~15% faster at one row and ~3% at 32 (2-core AMD EPYC,
AVX2; scripts/bench_decode_products.py), and decode attention reads the cache 3-8% faster.
Other devices get torch's own allocations.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def _mapped(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    # MAP_PRIVATE: a process forked later gets its own copy, never a view of this memory.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KB pages
            pass
    return torch.frombuffer(buf, dtype=dtype)  # the tensor keeps `buf` mapped


def zeros_on_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return _mapped(nbytes, dtype).view(shape)


def in_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor of 2 MB or more in memory advised for huge pages;
    other tensors as they are."""
    if tensor.device.type != "cpu" or tensor.nbytes < HUGE_PAGE:
        return tensor
    out = _mapped(tensor.nbytes, tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out
