"""The multi-LoRA kernel (layers/kernels/cpu_lora.cpp, Punica's BGMV) against the torch
reference it stands in for (meshserve.layers.lora_product.add_lora), in every build this CPU
runs: float32 and bf16, one row to more than a parallel task's worth, widths on and off the
vector paths, rows without an adapter left bit for bit as they were, and bad arguments refused."""

from __future__ import annotations

import pytest
import torch

from meshserve.layers.kernels import cpu_library
from meshserve.layers.lora_product import add_lora

pytestmark = pytest.mark.skipif(cpu_library.load() is None, reason="no C++ compiler for the CPU kernels")

# relative to the output's scale (~1-4 here): float32 sums in another order; bf16 one rounding
# of y, against a float32 reference from the same bf16 inputs
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_batch(rows, in_features, out_features, r, num_slots, dtype, seed=0):
    """y, x and the stacked adapters, scaled so that y and each delta are ~1."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, out_features, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    a = (torch.randn(num_slots, r, in_features, generator=g) / in_features**0.5).to(dtype)
    b = (torch.randn(num_slots, out_features, r, generator=g) / r**0.5).to(dtype)
    return y, x, a, b


def pick_slots(rows, num_slots, pattern, seed=0):
    g = torch.Generator().manual_seed(seed)
    if pattern == "none":
        return torch.full((rows,), -1, dtype=torch.long)
    if pattern == "one":
        return torch.full((rows,), num_slots - 1, dtype=torch.long)
    slots = torch.randint(-1, num_slots, (rows,), generator=g)
    slots[0] = -1  # at least one row without an adapter, and (rows > 1) one with
    if rows > 1:
        slots[-1] = num_slots // 2
    return slots


def reference(y, x, slots, a, b):
    """add_lora in float32 from the same (possibly bf16) inputs."""
    ones = torch.ones(a.shape[0])
    return add_lora(y.float(), x.float(), slots.long(), a.float(), b.float(), ones)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,in_features,out_features,r", [(1, 576, 960, 16), (7, 72, 200, 8), (32, 576, 960, 16),
                                                            (70, 72, 200, 8), (7, 72, 200, 5), (3, 8, 7, 16)])
@pytest.mark.parametrize("pattern", ["mixed", "none", "one"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=str)
def test_lora_add_matches_the_torch_reference(dtype, rows, in_features, out_features, r, pattern, slot_dtype,
                                              cpu_build):
    num_slots = 4
    y, x, a, b = make_batch(rows, in_features, out_features, r, num_slots, dtype)
    slots = pick_slots(rows, num_slots, pattern).to(slot_dtype)
    want = reference(y, x, slots, a, b)
    before, pointer = y.clone(), y.data_ptr()
    assert cpu_build.ops.lora_add(y, x, slots, a, b) is None
    assert y.data_ptr() == pointer and y.dtype == dtype
    scale = max(1.0, want.abs().max().item())
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), want, atol=tolerance * scale, rtol=tolerance)
    untouched = slots < 0
    assert torch.equal(y[untouched], before[untouched])
    if not bool(untouched.all()):  # the deltas moved the rows with an adapter
        assert not torch.equal(y[~untouched], before[~untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_without_an_adapter_are_left_bit_for_bit(dtype, cpu_build):
    """Rows with s < 0 keep their bits, NaN and -0.0 included (an add of 0.0 would turn -0.0
    into 0.0); the rows between them, on other slots, all move."""
    rows, num_slots = 33, 3
    y, x, a, b = make_batch(rows, 100, 130, 8, num_slots, dtype, seed=1)
    slots = torch.arange(rows) % (num_slots + 1) - 1  # -1, 0, 1, 2, -1, ...
    y[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -1e30]).to(dtype)
    before = y.clone()
    cpu_build.ops.lora_add(y, x, slots, a, b)
    untouched = slots < 0
    assert torch.equal(y[untouched].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       before[untouched].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert bool((y[~untouched] != before[~untouched]).any(dim=1).all())


def test_several_slots_each_use_their_own_adapter(cpu_build):
    """Each row against its own adapter's product alone: a row given another slot's weights
    (a mix-up in the grouping) fails here even where the sums look alike."""
    rows, num_slots, r = 20, 6, 16
    y, x, a, b = make_batch(rows, 96, 64, r, num_slots, torch.float32, seed=2)
    slots = torch.tensor([5, 0, 3, 3, -1, 1, 2, 4, 0, 5, 5, -1, 2, 1, 0, 3, 4, 4, 2, 1])
    want = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t] += (x[t] @ a[s].t()) @ b[s].t()
    cpu_build.ops.lora_add(y, x, slots, a, b)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_refused(cpu_build):
    y, x, a, b = make_batch(4, 32, 24, 8, 2, torch.float32)
    ops = cpu_build.ops
    with pytest.raises(RuntimeError, match="uses slot 2 of 2"):
        ops.lora_add(y, x, torch.tensor([0, 2, -1, 1]), a, b)
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        ops.lora_add(y, x, torch.zeros(4, dtype=torch.long), a.bfloat16(), b)
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        ops.lora_add(y.double(), x.double(), torch.zeros(4, dtype=torch.long), a.double(), b.double())
    with pytest.raises(RuntimeError, match="a must be contiguous"):
        ops.lora_add(y, x, torch.zeros(4, dtype=torch.long), a, b.transpose(1, 2))
    with pytest.raises(RuntimeError, match="one int64 or int32 slot per row"):
        ops.lora_add(y, x, torch.zeros(3, dtype=torch.long), a, b)
    with pytest.raises(RuntimeError, match="contiguous y"):
        ops.lora_add(y.t(), x, torch.zeros(4, dtype=torch.long), a, b)
