"""scripts/gpu_check.py without a GPU: its command line, its figures (bytes, FLOPs, MBU),
and every benchmark section run end to end at tiny sizes on CPU in Triton's interpreter
(--smoke-cpu, in a subprocess), so the script is known to work before a GPU runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshserve.layers.kernels import triton_available

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["gpu_check"]


def run_script(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def test_help_and_plan_need_no_gpu():
    out = run_script("--help")
    assert out.returncode == 0, out.stderr
    assert "--sections" in out.stdout and "MBU" in out.stdout
    out = run_script("--dry-run", "--sections", "decode", "prefill", "model")
    assert out.returncode == 0, out.stderr
    assert "decode: llama3-8b batch 32 context 4096 (512 MiB K/V)" in out.stdout
    assert "prefill: llama3-8b 1 x 2048 new tokens after 6144 cached" in out.stdout
    assert "model: SmolLM2 bf16" in out.stdout and "correctness" not in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so():
    out = run_script()
    assert out.returncode == 2 and "no CUDA device" in out.stdout


def test_figures(gpu_check):
    llama = gpu_check.HEAD_SHAPES["llama3-8b"]
    assert gpu_check.decode_kv_bytes(llama, 1, 4096) == 16 << 20  # K and V, 8 heads x 128, bf16
    tiny = gpu_check.HEAD_SHAPES["tiny"]  # 4 heads x 16
    # 3 new tokens attend to 1, 2, 3 keys; after a prefix of 5, to 6, 7, 8
    assert gpu_check.causal_attention_flops(tiny, [3]) == 4 * 4 * 16 * 6
    assert gpu_check.causal_attention_flops(tiny, [3, 3], prefix=5) == 2 * 4 * 4 * 16 * 21
    assert gpu_check.mbu(1e9, 100, 4e12) == pytest.approx(0.025)
    tables = gpu_check.paged_tables(3, 40, 16)
    assert sorted(b for t in tables for b in t) == list(range(9)) and all(len(t) == 3 for t in tables)
    assert tables != [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # shuffled, as a serving cache looks


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_every_section_runs_at_tiny_sizes(tiny_checkpoints, tmp_path):
    report = tmp_path / "report.json"
    out = run_script("--smoke-cpu", "--sections", "decode", "prefill", "norm_rotary", "model", "--model-path",
                     str(tiny_checkpoints["llama"]), "--batches", "1", "2", "--prompt-len", "8", "--output-len", "4",
                     "--output", str(report))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(report.read_text())
    assert not r["errors"]
    decode = r["sections"]["decode"]["rows"]
    assert decode and all(row["max_error"] < 5e-3 for row in decode)
    assert set(decode[0]["us"]) == {"triton", "triton_unsplit", "torch_backend", "sdpa_contiguous"}
    prefill = r["sections"]["prefill"]["rows"]
    assert len(prefill) == 2 and all(row["max_error"] < 5e-3 for row in prefill)
    assert {"norm_triton", "rotary_triton"} <= set(r["sections"]["norm_rotary"])
    model = r["sections"]["model"]["rows"]
    assert [row["batch"] for row in model] == [1, 2] and all(row["decode_tok_s"] > 0 and row["decode_mbu"] > 0
                                                              for row in model)
