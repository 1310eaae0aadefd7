"""The fused MoE Triton kernel on CPU, in Triton's interpreter, against a float64 loop over
the (token, slot) pairs: 1, 7 and 33 tokens, hidden 64 / inter 48 and hidden 32 / inter 64,
8 experts, top_k 1 and 2, routings where an expert gets nothing, where every token goes
to one expert, and with -1 ids (experts on another rank), with the default block sizes and
with 16x16x16 blocks (several N and K tiles); in float32 and float16. Then the alignment
step alone: every kept pair once, in its expert's blocks, no block for an expert without pairs.

NOTE: TRITON_INTERPRET=1 must be set before a kernel is defined, and would leak into every
other test of this process; the checks run in one subprocess (support.moe_kernel_cases)
and print JSON, which the tests below assert on row by row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshserve.layers.kernels import triton_available
from support.moe_kernel_cases import MOE_CHECKS

TESTS = Path(__file__).resolve().parents[1]
DTYPES = ["float32", "float16"]

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed (pip install -e '.[gpu]')")


@pytest.fixture(scope="module")
def moe_results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "support.moe_kernel_cases", "--device", "cpu", "--dtypes", *DTYPES],
                         cwd=TESTS, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def failures(rows) -> list[str]:
    assert rows, "a check without rows checks nothing"
    return [f"{what}: error {error:.3g} > {tol:.3g}" for what, error, tol in rows if not error <= tol]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(MOE_CHECKS))
def test_fused_moe_matches_reference(moe_results, name, dtype):
    bad = failures(moe_results[f"{name}|{dtype}"])
    assert not bad, f"{name} ({dtype}): " + "; ".join(bad)


def test_align_groups_pairs_by_expert(moe_results):
    bad = failures(moe_results["align"])
    assert not bad, "; ".join(bad)
