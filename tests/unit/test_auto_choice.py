"""`model.quantization: auto`: the path a config takes by itself, from `meshserve advise`'s
record for this machine or, without one, from the rule per CPU kind; and the advisor that
writes the record, measured on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest

from meshserve.configs import auto_choice, load_config
from meshserve.configs.auto_choice import Candidate, choose_auto, rule_choice
from meshserve.configs.cpu_features import CpuFeatures

AVX2 = CpuFeatures(frozenset({"avx2", "fma", "f16c"}))
AMX = CpuFeatures(frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx2", "avx512_bf16",
                             "amx_bf16", "amx_int8", "amx_tile", "avx512_vnni"}))


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setattr(auto_choice, "CACHE_ROOT", tmp_path)
    return tmp_path


def test_the_rule_per_cpu_kind():
    assert rule_choice("cpu", AVX2, "throughput") == Candidate("float32", "none")
    assert rule_choice("cpu", AVX2, "latency") == Candidate("bfloat16", "int4")
    assert rule_choice("cpu", AMX, "throughput") == Candidate("bfloat16", "none")
    assert rule_choice("cuda", AVX2, "latency") == Candidate("bfloat16", "none")


def test_auto_without_a_record_takes_the_rule_for_the_target(cache_root, monkeypatch):
    monkeypatch.setattr(auto_choice, "cpu_features", lambda: AVX2)
    config = load_config(None, ["model.quantization=auto"])
    assert (config.model.dtype, config.model.quantization) == ("float32", "none")
    config = load_config(None, ["model.quantization=auto", "scheduler.max_num_seqs=1"])
    assert (config.model.dtype, config.model.quantization) == ("bfloat16", "int4")
    # a dtype set by hand limits the choice to that dtype
    config = load_config(None, ["model.quantization=auto", "scheduler.max_num_seqs=1", "model.dtype=float32"])
    assert (config.model.dtype, config.model.quantization) == ("float32", "int4")
    _, line = choose_auto(load_config(None, ["scheduler.max_num_seqs=1"]), AVX2)
    assert "bfloat16+int4 for latency" in line and "the rule for" in line and "meshserve advise" in line


def test_auto_takes_the_record_of_this_machine(cache_root, monkeypatch):
    monkeypatch.setattr(auto_choice, "cpu_features", lambda: AVX2)
    base = load_config(None, [])
    path = auto_choice.advice_path(base, AVX2, auto_choice.threads_per_rank(base))
    assert path.is_relative_to(cache_root)
    path.parent.mkdir(parents=True)
    candidates = {"float32": {"latency": 20.0, "throughput": 150.0},
                  "bfloat16+int8": {"latency": 40.0, "throughput": 160.0},
                  "float32+int4": {"latency": 35.0, "throughput": 90.0},
                  "bfloat16+w8a8": {"latency": None, "throughput": None, "refused": "needs VNNI"}}
    path.write_text(json.dumps({"threads": 2, "choice": {"latency": "bfloat16+int8", "throughput": "bfloat16+int8"},
                                "candidates": candidates}))
    config = load_config(None, ["model.quantization=auto"])
    assert (config.model.dtype, config.model.quantization) == ("bfloat16", "int8")
    config = load_config(None, ["model.quantization=auto", "model.dtype=float32", "scheduler.max_num_seqs=1"])
    assert (config.model.dtype, config.model.quantization) == ("float32", "int4")
    _, line = choose_auto(base.model_copy(update={"scheduler": base.scheduler.model_copy(
        update={"max_num_seqs": 1})}), AVX2, path)
    assert "measured by `meshserve advise`" in line and "40.0 tok/s" in line


def test_advise_measures_each_path_and_auto_then_takes_its_choice(cache_root, tiny_checkpoints, monkeypatch):
    from meshserve.engine import advisor

    monkeypatch.setattr(advisor, "DECODE_STEPS", 2)
    path = tiny_checkpoints["llama-untied"]
    config = load_config(None, [f"model.path={path}", "scheduler.max_num_seqs=4"])
    candidates = (Candidate("float32", "none"), Candidate("bfloat16", "int8"), Candidate("bfloat16", "w8a8"))
    lines = []
    advice = advisor.advise(config, progress=lines.append, candidates=candidates)
    measured = {m.name: m for m in advice.measured}
    for name in ("float32", "bfloat16+int8"):
        m = measured[name]
        assert m.refused is None and m.prefill_ms > 0 and set(m.decode_ms) == {1, 4}
        assert m.tok_s(4) == pytest.approx(1000 * 4 * 128 / (4 * m.prefill_ms + 128 * m.decode_ms[4]))
    if not auto_choice.cpu_features().vnni:
        assert "VNNI" in measured["bfloat16+w8a8"].refused
    record = json.loads(open(advice.path).read())
    assert record["choice"]["throughput"] == advice.best(4).name
    chosen = load_config(None, [f"model.path={path}", "scheduler.max_num_seqs=4", "model.quantization=auto"])
    assert chosen.model.dtype + ("" if chosen.model.quantization == "none" else "+" + chosen.model.quantization) \
        == advice.best(4).name
    text = advisor.report(advice)
    assert "for latency (c=1)" in text and "for throughput (c=4)" in text and "--set model.quantization=" in text
