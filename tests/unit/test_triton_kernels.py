"""meshserve's Triton kernels on CPU, in Triton's interpreter, against float64 math and the
torch backend: paged decode and prefill attention with their LSEs (block sizes 1 to 64,
MHA/GQA/MQA, ragged lengths, block tables with holes, chunks after a cached prefix, split
decode, decode rows skipping keys as a draft tree's do), context parallelism's LSE parts, fused RMSNorm + residual, in-place rotary; in
float32 and float16. Then the whole model (float32) with the Triton backend forced: the
same greedy tokens as the torch backend, and logits within 1e-4 of its scale.

NOTE: TRITON_INTERPRET=1 must be set before a kernel is defined, and would leak into every
other test of this process; the checks run in one subprocess per group (support.kernel_cases)
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
from support.kernel_cases import KERNEL_CHECKS

TESTS = Path(__file__).resolve().parents[1]
DTYPES = ["float32", "float16"]

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed (pip install -e '.[gpu]')")


def interpret(*args: str, timeout: int = 300) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "support.kernel_cases", *args, "--device", "cpu"], cwd=TESTS, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def kernel_results():
    return interpret("kernels", "--dtypes", *DTYPES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(KERNEL_CHECKS))
def test_kernel_matches_reference(kernel_results, name, dtype):
    rows = kernel_results[f"{name}|{dtype}"]
    assert rows, "a check without rows checks nothing"
    bad = [f"{what}: error {error:.3g} > {tol:.3g}" for what, error, tol in rows if not error <= tol]
    assert not bad, f"{name} ({dtype}): " + "; ".join(bad)


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])  # qwen3-moe: per-head q/k norms, the fused MoE kernel
def test_model_with_triton_backend_matches_torch(tiny_checkpoints, kind):
    # float32 only: the kernels' float16 paths are checked above, and each run costs seconds here
    r = interpret("model", "--model-path", str(tiny_checkpoints[kind]), "--dtypes", "float32")["float32"]
    assert r["triton"] == r["torch"], "greedy tokens differ"
    assert len(r["torch"]) == 3 and all(len(t) == 6 for t in r["torch"])
    assert r["logits_max_diff"] <= 1e-4 * r["logits_scale"], (r["logits_max_diff"], r["logits_scale"])
