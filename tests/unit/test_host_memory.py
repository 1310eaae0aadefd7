"""layers.host_memory: the KV cache's zeros cost no memory until written, read as
torch.zeros reads, and go back to the system with the tensor."""

from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch

from meshserve.layers.host_memory import zeros_on_touch


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_zeros_on_touch_are_zeros_that_take_memory_only_where_written(dtype):
    shape = (256, 16, 8, 512)  # 16M elements: 16-64 MiB
    before = _status_mib("VmRSS")
    cache = zeros_on_touch(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert _status_mib("VmRSS") - before < 8  # nothing resident yet
    cache[3].fill_(2)
    expected = torch.zeros(shape, dtype=dtype)
    expected[3].fill_(2)
    assert torch.equal(cache, expected)
    assert cache.data_ptr() % 64 == 0


def test_the_memory_goes_back_with_the_tensor_and_a_fork_does_not_share_it():
    before = _status_mib("VmSize")
    cache = zeros_on_touch((1 << 28,), torch.float32)  # 1 GiB of address space
    assert _status_mib("VmSize") - before >= 1000
    cache[:10] = 1.0
    pid = os.fork()
    if pid == 0:
        ctypes.memset(cache.data_ptr(), 0x40, 40)  # the child's copy (no torch call after a fork)
        os._exit(0)
    os.waitpid(pid, 0)
    assert cache[:10].eq(1.0).all()
    del cache
    gc.collect()
    assert _status_mib("VmSize") - before < 100


def test_other_devices_get_torch_zeros():
    t = zeros_on_touch((4, 3), torch.float32, "meta")
    assert t.device.type == "meta" and t.shape == (4, 3)
