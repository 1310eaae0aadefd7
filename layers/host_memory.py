"""Host memory for the KV cache: an anonymous private map, zeroed by the kernel page by
page on first touch.

torch.zeros writes every byte: a 1 GiB KV cache took seconds of a start, all of it resident
though a short run writes a few blocks. `zeros_on_touch` maps memory the kernel hands out
zeroed on first touch instead; pages never written take no memory. The map is not advised
for transparent huge pages: in 2 MB pages the decode attention read its scattered blocks a
little faster, but on a machine whose kernel compacts memory for advised maps
(`defrag: madvise`) a first touch of a large cache cost many times what it costs in 4 KB
pages (scripts/bench_cache_pages.py), paid by the first requests a server serves.
Other devices get torch.zeros.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeros_on_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # MAP_PRIVATE: a process forked later gets its own copy, never a view of this memory.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps `buf` mapped
