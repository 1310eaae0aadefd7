"""scripts/bench_vs_vllm.py's roofline, without a server: the output tok/s a workload allows
is its output tokens over the sum of its steps, each step as long as the slower of its
FLOPs and its bytes; and the loader's log line says whether the weights were kept in bf16."""

from __future__ import annotations

import pytest

from meshserve.configs.model_info import ModelInfo
from meshserve.engine.perf import ModelCost

from support.scripts import script_module


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_vs_vllm") as module:
        yield module


@pytest.fixture(scope="module")
def cost():
    info = ModelInfo(architecture="LlamaForCausalLM", format="hf", path="tiny", hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=1000, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                     tie_word_embeddings=True, attention_bias=False)
    return ModelCost(info, 4)


def test_compute_bound_workload_is_its_flops_at_the_peak(bench, cost):
    peak, inp, out, c = 1e9, 16, 8, 4
    flops = cost.flops(inp, inp) + sum(cost.flops(1, ctx) for ctx in range(inp + 1, inp + out))
    got = bench.roofline_tok_s(cost, c, inp, out, peak, bandwidth=1e30)
    assert got == pytest.approx(out * peak / flops, rel=1e-9)
    # compute-bound: the concurrency does not change it
    assert bench.roofline_tok_s(cost, 1, inp, out, peak, 1e30) == pytest.approx(got, rel=1e-9)


def test_bandwidth_bound_decode_reads_the_weights_each_step(bench, cost):
    bw, inp, out = 1e9, 16, 8
    steps = [cost.weight_bytes] + [cost.weight_bytes + ctx * cost.kv_bytes_per_token
                                   for ctx in range(inp + 1, inp + out)]
    one = bench.roofline_tok_s(cost, 1, inp, out, peak=1e30, bandwidth=bw)
    assert one == pytest.approx(out * bw / sum(steps), rel=1e-9)
    # c sequences share each step's weight reads: more than c=1's, less than c times it
    four = bench.roofline_tok_s(cost, 4, inp, out, peak=1e30, bandwidth=bw)
    assert one < four < 4 * one


def test_the_slower_bound_wins(bench, cost):
    both = bench.roofline_tok_s(cost, 8, 16, 8, peak=1e9, bandwidth=1e9)
    assert both <= bench.roofline_tok_s(cost, 8, 16, 8, peak=1e9, bandwidth=1e30)
    assert both <= bench.roofline_tok_s(cost, 8, 16, 8, peak=1e30, bandwidth=1e9)


def test_kept_bf16_reads_the_loaders_line(bench, tmp_path):
    log = tmp_path / "meshserve.log"
    log.write_text("INFO meshserve.layers.loader: 121 of 121 weights hold only bf16 numbers (a bf16 checkpoint): "
                   "kept in bf16, half the bytes, and widened exactly in the products\n")
    assert bench.kept_bf16(log)
    log.write_text("INFO meshserve: building the model: 30 layers of 30, float32\n")
    assert not bench.kept_bf16(log)


def test_vllm_gets_the_preloads_its_cpu_guide_asks_for(bench, tmp_path):
    system, venv = tmp_path / "system", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    system.mkdir()
    python = str(venv / "bin" / "python")
    assert bench.vllm_preload(python, (str(system),)) == []
    (system / "libtcmalloc_minimal.so.4").touch()
    (venv / "lib" / "libiomp5.so").touch()
    assert bench.vllm_preload(python, (str(tmp_path / "absent"), str(system))) == [
        system / "libtcmalloc_minimal.so.4", venv / "lib" / "libiomp5.so"]
