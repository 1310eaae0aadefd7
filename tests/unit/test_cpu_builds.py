"""What the CPU can run and which kernel build runs: CPU flags parsed from /proc/cpuinfo's
text, the builds each kind of CPU runs, config refusals naming the missing feature, and
the build folder: keyed by the install (sources' place and text) and torch, guarded by an
flock, a stale torch build lock removed, a second process loading without the compiler.
Then the start-up caches (GGUF header, converted tokenizer) against uncached reads."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
import time

import pytest

from meshserve.configs import ConfigError, load_config
from meshserve.configs.cpu_features import CpuFeatures, cpu_features, parse_cpuinfo
from meshserve.configs.gguf_meta import read_gguf_header
from meshserve.configs.model_info import read_model_info
from meshserve.configs.validate import check_config, kernel_problems
from meshserve.layers.kernels import cpu_library

AVX2_ONLY = parse_cpuinfo("processor\t: 0\nflags\t\t: fpu sse sse2 avx fma f16c avx2 bmi2\n\nprocessor\t: 1\n")
AVX512_AMX = parse_cpuinfo("flags\t\t: sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni "
                           "avx512_bf16 amx_tile amx_bf16 amx_int8\n")
UNKNOWN = CpuFeatures(frozenset(), known=False)


def test_each_kind_of_cpu_runs_its_builds_and_says_what_it_lacks():
    assert AVX2_ONLY.runnable_isas == ("avx2", "scalar") and AVX2_ONLY.best_isa == "avx2"
    assert not AVX2_ONLY.vnni and not AVX2_ONLY.bf16_compute
    assert AVX2_ONLY.describe() == "no AVX-512, AVX2 FMA, no VNNI, no AVX512-BF16, no AMX"
    assert AVX512_AMX.runnable_isas == ("avx512", "avx2", "scalar")
    assert AVX512_AMX.vnni and AVX512_AMX.bf16_compute and "AMX" in AVX512_AMX.describe()
    assert UNKNOWN.runnable_isas == ("scalar",) and UNKNOWN.vnni  # nothing refused where flags are unknown
    assert not parse_cpuinfo("no flags here").known
    with pytest.raises(ValueError, match="unknown CPU kernel build 'sse9'"):
        AVX2_ONLY.runs("sse9")
    assert cpu_features().runs("scalar")


def test_a_build_the_cpu_cannot_run_is_a_config_error(tiny_checkpoints):
    config = load_config(None, [f"model.path={tiny_checkpoints['llama']}", "device.cpu_isa=avx512"])
    problems = kernel_problems(config, AVX2_ONLY)
    assert problems == ["device.cpu_isa=avx512: this CPU (no AVX-512, AVX2 FMA, no VNNI, no AVX512-BF16, no AMX) "
                        "cannot run that build of meshserve's C++ kernels (use device.cpu_isa auto, avx2 or scalar)"]
    assert kernel_problems(config, AVX512_AMX) == []
    if not cpu_features().runs("avx512"):
        with pytest.raises(ConfigError, match="device.cpu_isa=avx512: this CPU"):
            check_config(config)
        with pytest.raises(ValueError, match="cannot run the avx512 build"):
            cpu_library.library("avx512")


def test_the_build_folder_is_keyed_by_the_install_and_the_flags(tmp_path):
    assert cpu_library.build_key("avx2") == cpu_library.build_key("avx2")
    assert cpu_library.build_key("avx2") != cpu_library.build_key("scalar")
    copy = tmp_path / "kernels"
    shutil.copytree(cpu_library.KERNEL_DIR, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    other_install = cpu_library.build_key("avx2", copy)
    assert other_install != cpu_library.build_key("avx2")  # two installs never share (and rebuild) a folder
    (copy / "cpu_vec.h").write_text((copy / "cpu_vec.h").read_text() + "\n// changed\n")
    assert cpu_library.build_key("avx2", copy) != other_install
    assert cpu_library.build_directory("avx2", tmp_path).parent == tmp_path


def test_builders_of_one_folder_take_turns_and_a_stale_torch_lock_is_removed(tmp_path, caplog):
    folder = tmp_path / "build"
    folder.mkdir()
    (folder / "lock").write_text("")  # what a build killed by SIGTERM leaves behind
    entered = threading.Event()

    def second_builder():
        with cpu_library.build_lock(folder):
            entered.set()

    with caplog.at_level(logging.INFO, logger=cpu_library.__name__):
        with cpu_library.build_lock(folder):
            assert not (folder / "lock").exists()
            assert "removing a stale build lock" in caplog.text
            thread = threading.Thread(target=second_builder)
            thread.start()
            time.sleep(0.3)
            assert not entered.is_set()  # it waits for the first
        thread.join(10)
    assert entered.is_set()
    assert "waiting for another process that is building" in caplog.text


def test_a_second_process_loads_the_built_library_without_the_compiler():
    if not cpu_library.library("scalar"):
        pytest.skip("no C++ compiler for the CPU kernels")
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
            "from meshserve.layers.kernels import cpu_library as c; lib = c.load('scalar'); assert lib; "
            "import torch; x = torch.randn(3, 8); print(bool((lib.ops.silu_and_mul(x) - "
            "torch.nn.functional.silu(x[:, :4]) * x[:, 4:]).abs().max() < 1e-5))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"
    assert "building meshserve's C++ CPU kernels" not in out.stderr


def test_the_cached_gguf_header_and_tokenizer_match_uncached_reads(smollm2, tmp_path):
    from meshserve.engine.tokenizer import load_tokenizer

    uncached = read_gguf_header(smollm2, cache_root=None)
    assert read_gguf_header(smollm2, cache_root=tmp_path) == uncached  # written
    assert list((tmp_path / "gguf").glob("*.json"))
    assert read_gguf_header(smollm2, cache_root=tmp_path) == uncached  # read back
    assert read_model_info(str(smollm2)).num_hidden_layers == 30

    converted = load_tokenizer(smollm2, cache_root=tmp_path)
    saved = load_tokenizer(smollm2, cache_root=tmp_path)
    assert converted is not saved and list((tmp_path / "tokenizers").iterdir())
    text = "Hello, world! Ünïcödé 漢字 and code: `x = f(y) ** 2`\n\n  spaces"
    assert saved.encode(text) == converted.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    assert (saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert (saved.eos_token_id, saved.bos_token_id) == (converted.eos_token_id, converted.bos_token_id)
    ids = converted.encode(text)
    assert saved.decode(ids) == converted.decode(ids)


def test_the_start_up_line_names_the_build_and_the_kernels(cpu_build):
    """The line is what the chosen objects say: the backend and the matmul plan, whose dense
    kernel says `kept in bf16` once every weight it prepared was kept so."""
    import torch

    from meshserve.layers.backend import TorchBackend, kernel_summary
    from meshserve.layers.cpu_backend import CpuBackend
    from meshserve.layers.matmul_plan import plan_matmuls

    isa = cpu_build.isa
    plan = plan_matmuls("cpu", torch.float32, library=cpu_build)
    line = kernel_summary(CpuBackend(cpu_build), plan, 64)
    assert f"C++ paged decode ({isa} build)" in line and f"norm/act/rotary: C++ ({isa} build)" in line
    assert ("prefill C++ causal" in line) == (isa == "avx512") and "AMX tiles" not in line
    from meshserve.layers.kernels.cpu_attention import amx_prefill_runs
    bf16_line = kernel_summary(CpuBackend(cpu_build), plan, 64, torch.bfloat16)
    assert ("prefill C++ causal on AMX tiles" in bf16_line) == amx_prefill_runs(cpu_build, torch.bfloat16, 64)
    if isa != "scalar":
        name = {"avx2": "AVX2", "avx512": "AVX-512"}[isa]
        assert line.startswith(f"matmul: C++ {name} on float32 weights in panels;")
        plan.linear.prepare(torch.randn(32, 16).bfloat16().float())  # a bf16 checkpoint's numbers
        kept = kernel_summary(CpuBackend(cpu_build), plan, 64)
        assert kept.startswith(f"matmul: C++ {name} on float32 weights in panels kept in bf16")
    else:
        assert line.startswith("matmul: oneDNN packed float32" if torch.backends.mkldnn.is_available() else "matmul: torch")
    int4 = plan_matmuls("cpu", torch.bfloat16, "int4", cpu_build)
    head = ("int8 weights times int8 rows (torch's _int_mm)" if cpu_features().vnni
            else "int8 weights (torch's _weight_int8pack_mm)")
    assert kernel_summary(TorchBackend(), int4, 64) == (
        f"matmul: int4 groups (torch's _weight_int4pack_mm), the head {head}; attention, norm/act: torch backend")
    assert kernel_summary(TorchBackend(), plan_matmuls("cpu", torch.float32, "int8", cpu_build), 64).startswith(
        "matmul: int8 weights (torch's _weight_int8pack_mm) on bfloat16 inputs;")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported() and isa != "avx2":
        bf16 = plan_matmuls("cpu", torch.bfloat16, library=cpu_build)
        assert "oneDNN float32 on widened weights" in kernel_summary(TorchBackend(), bf16, 64)
