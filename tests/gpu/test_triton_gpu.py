"""The Triton kernel checks of tests/unit/test_triton_kernels.py compiled for a real GPU, in
bfloat16 too (which the interpreter cannot check), and the whole model on CUDA with the
Triton backend against the torch backend. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from meshserve.layers.kernels import triton_available
from support.kernel_cases import KERNEL_CHECKS, compare_backends, run_kernel_checks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not triton_available(), reason="triton not installed (pip install -e '.[gpu]')")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("name", list(KERNEL_CHECKS))
def test_kernel_on_gpu(name, dtype):
    rows = run_kernel_checks([dtype], "cuda", [name])[f"{name}|{dtype}"]
    bad = [f"{what}: error {error:.3g} > {tol:.3g}" for what, error, tol in rows if not error <= tol]
    assert rows and not bad, f"{name} ({dtype}): " + "; ".join(bad)


def test_model_float32_same_greedy_tokens(tiny_checkpoints):
    r = compare_backends(str(tiny_checkpoints["llama"]), torch.float32, "cuda")
    assert r["triton"] == r["torch"]
    assert r["logits_max_diff"] <= 1e-3 * r["logits_scale"]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-6h"])
def test_model_bfloat16_logits_close(tiny_checkpoints, kind):
    # bf16 may flip a near-tie between two tokens, so compare logits teacher-forced on the
    # torch backend's tokens rather than free-running tokens
    r = compare_backends(str(tiny_checkpoints[kind]), torch.bfloat16, "cuda")
    assert r["logits_max_diff"] <= 5e-2 * r["logits_scale"], r
