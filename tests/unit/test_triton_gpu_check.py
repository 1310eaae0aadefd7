"""scripts/gpu_check.py without a GPU: its command line, its figures (bytes, FLOPs, MBU),
and every benchmark section run end to end at tiny sizes on CPU in Triton's interpreter
(--smoke-cpu, in a subprocess), so the script is known to work before a GPU runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshserve.layers.kernels import triton_available

from support.scripts import script_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    with script_module("gpu_check") as module:
        yield module


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
    assert "model: smollm2, llama-1b, llama-8b bf16" in out.stdout and "correctness" not in out.stdout
    out = run_script("--dry-run", "--sections", "hf_model", "serving", "--models", "llama-1b")
    assert out.returncode == 0, out.stderr
    assert "hf_model: llama-1b bf16 vs transformers" in out.stdout
    assert "serving: llama-1b, meshserve bench at concurrency 1, 32, 128" in out.stdout


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
    out = run_script("--smoke-cpu", "--sections", "hf_model", "model", "serving", "decode", "prefill", "norm_rotary",
                     "--model-path", str(tiny_checkpoints["llama"]), "--batches", "1", "2", "--prompt-len", "8",
                     "--output-len", "4", "--output", str(report), "--work-dir", str(tmp_path), timeout=300)
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
    assert r["sections"]["model"]["prefill"][0]["tokens"] == 16 and r["sections"]["model"]["prefill"][0]["mfu"] > 0
    # the whole engine against transformers, float32 on CPU: equal up to float32 rounding
    hf = r["sections"]["hf_model"]
    assert not hf["failed"] and not hf["errors"]
    assert hf["models"]["custom"]["relative_logprob_error"] < 1e-3 and hf["models"]["custom"]["greedy_agreement"] == 1
    assert hf["models"]["custom"]["tokens_compared"] == (5 - 1 + 4) + (9 - 1 + 4)
    # a real server and `meshserve bench`: every request completed, the steps counted from /metrics
    # with overlapped steps at each concurrency, then without at the last
    serving = r["sections"]["serving"]["rows"]
    assert [(row["concurrency"], row["overlap"]) for row in serving] == [(1, True), (2, True), (2, False)]
    assert all(row["completed"] == row["num_prompts"] == 8 and row["output_throughput"] > 0 for row in serving)
    assert all(row["steps"] > 0 and 0 < row["engine_busy"] <= 1.05 for row in serving)
    summary = r["summary"]["custom"]
    assert summary["concurrency"] == 2 and summary["engine_decode_tok_s"] == model[1]["decode_tok_s"]
    assert summary["served_over_engine"] == pytest.approx(serving[1]["output_throughput"] / model[1]["decode_tok_s"])
    assert summary["plain_served_over_engine"] > 0 and summary["decode_b1_mbu"] == model[0]["decode_mbu"]


def test_logprob_comparison_tells_a_wrong_model(gpu_check, tiny_checkpoints):
    """The whole-model oracle: transformers' own logprobs score 0, another model's fail."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from meshserve.comm.messages import TokenLogprob

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["llama"]), dtype=torch.float32).eval()
    other = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["llama-untied"]), dtype=torch.float32).eval()
    prompt, output = [5, 17, 300, 42, 7], [11, 99, 1234]

    def completion(model):
        full = prompt + output
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
        got = [TokenLogprob(t, float(lp[i, t]), []) for i, t in enumerate(full[1:])]
        return SimpleNamespace(token_ids=output, prompt_logprobs=[None, *got[:len(prompt) - 1]],
                               logprobs=got[len(prompt) - 1:])

    gpu_check.SETUP = gpu_check.Setup("cpu")
    same = gpu_check.logprob_comparison([prompt], [completion(hf)], hf)
    assert same["tokens_compared"] == 7 and same["relative_logprob_error"] < 1e-6
    wrong = gpu_check.logprob_comparison([prompt], [completion(other)], hf)
    assert wrong["relative_logprob_error"] > gpu_check.HF_TOLERANCE["relative_logprob_error"]
