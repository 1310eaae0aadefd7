"""The multi-LoRA Triton kernels (meshserve.layers.kernels.lora) on CPU, in Triton's
interpreter, against the torch reference (layers/lora_product.add_lora) in float64 and in
the kernels' dtype: 1, 5 and 33 rows, r 8 and 16, and r 48 for a stacked QKV shrink (three
adapters' A side by side, B block-diagonal); in 72 and out 200, not multiples of the
blocks; several slots in a batch, int32 and int64 slots; rows with slot -1 exactly as they
were; a batch with no adapter and one with no rows; float32 and float16.

NOTE: TRITON_INTERPRET=1 must be set before a kernel is defined, and would leak into every
other test of this process; the checks run in one subprocess (this file run as a script,
which sets it before importing the kernel module) and print JSON, which the tests below
assert on row by row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from meshserve.layers.kernels import triton_available

DTYPES = {"float32": torch.float32, "float16": torch.float16}
TOL = {torch.float32: 1e-5, torch.float16: 1e-3}
"""Max abs error over the reference's max abs, against add_lora in float64 (float16: about
one unit in the last place of the largest output, which the kernels round once)."""
SAME_DTYPE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
"""Against add_lora in the kernels' dtype, which rounds after each product too."""
IN_FEATURES, OUT_FEATURES, NUM_SLOTS = 72, 200, 4
QKV_OUT = (120, 40, 40)
"""The stacked case's q, k and v widths (sum OUT_FEATURES), one adapter of r 16 each."""
CASES = {
    "rows 1, r 8": dict(rows=1, rank=8),
    "rows 1, r 16": dict(rows=1, rank=16, slots_dtype=torch.int32),
    "rows 5, r 8": dict(rows=5, rank=8, slots_dtype=torch.int32),
    "rows 5, r 16": dict(rows=5, rank=16),
    "rows 33, r 8": dict(rows=33, rank=8),
    "rows 33, r 16": dict(rows=33, rank=16, slots_dtype=torch.int32),
    "rows 33, stacked qkv r 48": dict(rows=33, rank=48, stacked=True),
    "rows 5, no adapter": dict(rows=5, rank=16, no_adapter=True),
    "no rows": dict(rows=0, rank=16),
}

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed (pip install -e '.[gpu]')")

Row = tuple[str, float, float]


# ---------------------------------------------------------------- inputs and checks (in the subprocess)


def make_slots(rows: int, no_adapter: bool, g: torch.Generator) -> torch.Tensor:
    """(rows,) slots in -1 .. NUM_SLOTS - 1. One row: slot 2. More: random, with the first
    row -1 and slots 0 and NUM_SLOTS - 1 used. No adapter: all -1."""
    if no_adapter or rows == 0:
        return torch.full((rows,), -1)
    if rows == 1:
        return torch.tensor([2])
    slots = torch.randint(-1, NUM_SLOTS, (rows,), generator=g)
    slots[0], slots[1], slots[-1] = -1, 0, NUM_SLOTS - 1
    return slots


def make_b(rank: int, stacked: bool, g: torch.Generator) -> torch.Tensor:
    """(NUM_SLOTS, OUT_FEATURES, rank); stacked: q, k and v's B on the diagonal, each of r
    rank / 3, zeros elsewhere."""
    if not stacked:
        return torch.randn(NUM_SLOTS, OUT_FEATURES, rank, generator=g) * rank ** -0.5
    part = rank // len(QKV_OUT)
    b = torch.zeros(NUM_SLOTS, OUT_FEATURES, rank)
    row = 0
    for i, width in enumerate(QKV_OUT):
        b[:, row:row + width, i * part:(i + 1) * part] = torch.randn(NUM_SLOTS, width, part, generator=g) * part ** -0.5
        row += width
    return b


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if not want.numel():
        return 0.0
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def check_case(dtype: torch.dtype, rows: int, rank: int, slots_dtype=torch.int64, stacked: bool = False,
               no_adapter: bool = False, seed: int = 0) -> list[Row]:
    from meshserve.layers.kernels.lora import lora_add
    from meshserve.layers.lora_product import add_lora

    g = torch.Generator().manual_seed(seed + 100 * rows + rank)
    x = torch.randn(rows, IN_FEATURES, generator=g).to(dtype)
    y = torch.randn(rows, OUT_FEATURES, generator=g).to(dtype)
    a = (torch.randn(NUM_SLOTS, rank, IN_FEATURES, generator=g) * IN_FEATURES ** -0.5).to(dtype)
    b = make_b(rank, stacked, g).to(dtype)
    slots = make_slots(rows, no_adapter, g).to(slots_dtype)
    ones = torch.ones(NUM_SLOTS)
    want64 = add_lora(y.double(), x.double(), slots, a.double(), b.double(), ones.double())
    want = add_lora(y, x, slots, a, b, ones)
    before = y.clone()
    lora_add(y, x, slots, a, b)
    off = slots < 0
    return [("vs add_lora in float64", rel_err(y, want64), TOL[dtype]),
            (f"vs add_lora in {str(dtype).removeprefix('torch.')}", rel_err(y, want), SAME_DTYPE_TOL[dtype]),
            ("rows with slot -1 changed", float(not torch.equal(y[off], before[off])), 0.0)]


def check_refusals() -> list[Row]:
    """Mixed dtypes and mismatched shapes raise ValueError before any launch."""
    from meshserve.layers.kernels.lora import lora_add

    y, x = torch.zeros(3, 8), torch.zeros(3, 4)
    a, b, slots = torch.zeros(2, 16, 4), torch.zeros(2, 8, 16), torch.zeros(3, dtype=torch.long)
    bad = {"half b": (y, x, slots, a, b.half()), "b of the wrong r": (y, x, slots, a, torch.zeros(2, 8, 8)),
           "float slots": (y, x, slots.float(), a, b), "slots of other rows": (y, x, slots[:2], a, b)}
    rows = []
    for what, args in bad.items():
        try:
            lora_add(*args)
            rows.append((f"{what}: accepted", 1.0, 0.0))
        except ValueError:
            rows.append((f"{what}: refused", 0.0, 0.0))
    return rows


def run_checks(dtypes: list[str]) -> dict[str, list[Row]]:
    results = {f"{name}|{d}": check_case(DTYPES[d], **case) for d in dtypes for name, case in CASES.items()}
    results["refusals"] = check_refusals()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = ap.parse_args()
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
    torch.set_num_threads(1)
    json.dump(run_checks(args.dtypes), sys.stdout)


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def lora_results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--dtypes", *DTYPES], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def failures(rows) -> list[str]:
    assert rows, "a check without rows checks nothing"
    return [f"{what}: error {error:.3g} > {tol:.3g}" for what, error, tol in rows if not error <= tol]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_lora_add_matches_reference(lora_results, name, dtype):
    bad = failures(lora_results[f"{name}|{dtype}"])
    assert not bad, f"{name} ({dtype}): " + "; ".join(bad)


def test_lora_add_refuses_mismatched_inputs(lora_results):
    bad = failures(lora_results["refusals"])
    assert not bad, "; ".join(bad)


if __name__ == "__main__":
    main()
