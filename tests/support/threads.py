"""Fixtures about the threads a test process runs."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny tensors: intra-op threads only add overhead (a pool's wake-up per op on a small
    machine). Autouse in every module that imports it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
