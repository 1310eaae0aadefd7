"""Zero-filled tensors that cost nothing until written: the KV cache.

torch.zeros writes every byte: a 1 GiB cache takes seconds of a start, and all of it
resident though a short run writes a few blocks. On the CPU this maps anonymous private
memory instead: the kernel hands out zeroed pages on first touch, and pages never written
take no memory. Other devices get torch.zeros.
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
    # MAP_PRIVATE: a process forked later gets its own copy, never a view of this cache.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps `buf` mapped
