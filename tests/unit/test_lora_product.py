"""The grouped LoRA product (layers/lora_product.py) against one row at a time: rows of
several adapters and of none in one batch, adapters of smaller ranks padded with zeros,
float32 and bfloat16; no row with an adapter gives no delta."""

from __future__ import annotations

import pytest
import torch

from meshserve.layers.lora_product import add_lora, group_rows, lora_delta

SLOTS, RANK, IN, OUT = 4, 16, 48, 40


def stacks(seed: int = 0, ranks=(16, 8, 4, 16)):
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(SLOTS, RANK, IN)
    b = torch.zeros(SLOTS, OUT, RANK)
    for s, r in enumerate(ranks):  # a smaller rank sits in the first r rows of A, columns of B
        a[s, :r] = torch.randn(r, IN, generator=g)
        b[s, :, :r] = torch.randn(OUT, r, generator=g)
    return a, b, torch.tensor([0.5, 2.0, 1.0, 0.25])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_its_adapters_delta_and_rows_without_one_none(dtype):
    a, b, scaling = stacks()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(23, IN, generator=g).to(dtype)
    slots = torch.tensor([0, -1, 3, 1, 1, 2, -1, 0, 3, 3, 2, 1, 0, -1, 2, 2, 1, 0, 3, -1, 1, 0, 2])
    y = torch.randn(23, OUT, generator=g).to(dtype)
    got = add_lora(y, x, slots, a, b, scaling)
    want = y.float().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t] += scaling[s] * (x[t].float() @ a[s].t() @ b[s].t())
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # bfloat16's rounding, relative to the whole (elements near zero carry their neighbours' error)
        assert (got.float() - want).norm() / want.norm() < 1e-2
    assert [s for s, _ in group_rows(slots)] == [0, 1, 2, 3]


def test_a_batch_without_adapters_is_left_as_it_is():
    a, b, scaling = stacks()
    x, y = torch.randn(5, IN), torch.randn(5, OUT)
    assert lora_delta(x, torch.full((5,), -1), a, b, scaling) is None
    assert add_lora(y, x, torch.full((5,), -1), a, b, scaling) is y
