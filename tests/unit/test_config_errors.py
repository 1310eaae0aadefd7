"""One test per class of configuration mistake: each fails before any rank starts, with a
message that names the file, the dotted key and the numbers involved."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from meshserve.configs import Config, ConfigError, load_config
from meshserve.configs.config_file import BUILTIN_SOURCE, parse_override
from meshserve.configs.cpu_features import CpuFeatures, cpu_features
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.launcher.cli import main

SMOLLM2 = "builtin:smollm2-135m-instruct"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def load_error(path: Path | None, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def check_error(config: Config, source: str) -> str:
    with pytest.raises(ConfigError) as e:
        check_config(config, source)
    return str(e.value)


def tiny_config(tiny_checkpoints, tmp_path: Path, body: str, name: str = "tiny.yaml") -> tuple[Config, str]:
    """A YAML file naming the tiny Llama checkpoint (4 heads, 2 KV heads, 3 layers, 512 positions)."""
    text = f"model:\n  path: {tiny_checkpoints['llama']}\n  dtype: float32\n" + body
    p = write(tmp_path, name, text)
    return load_config(p), str(p)


def modified_checkpoint(tiny_checkpoints, tmp_path: Path, **changes) -> Path:
    """A copy of the tiny Llama config.json with some sizes changed (config only: validation
    reads no weights)."""
    d = tmp_path / "modified"
    d.mkdir()
    cfg = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# ---------------------------------------------------------------- schema: loader + pydantic


def test_unknown_top_level_key_names_file_and_key(tmp_path):
    p = write(tmp_path, "typo.yaml", "modle:\n  dtype: float32\n")
    assert load_error(p) == f"{p}: modle: unknown key (did you mean model?)"


def test_unknown_nested_key_names_dotted_path(tmp_path):
    p = write(tmp_path, "nested.yaml", "parallel:\n  tensor: 1\n  tensr: 2\n")
    assert load_error(p) == f"{p}: parallel.tensr: unknown key (did you mean parallel.tensor?)"


def test_unknown_key_from_override_names_dotted_path():
    msg = load_error(None, ["scheduler.max_num_seq=8"])
    assert msg == f"{BUILTIN_SOURCE}: scheduler.max_num_seq: unknown key (did you mean scheduler.max_num_seqs?)"


def test_an_unknown_key_like_no_other_lists_its_section():
    msg = load_error(None, ["cache.qqq=1"])
    assert msg == (f"{BUILTIN_SOURCE}: cache.qqq: unknown key (the keys of cache: block_size, memory, num_blocks, "
                   f"dtype, prefix_caching)")


def test_several_schema_errors_are_all_reported(tmp_path):
    p = write(tmp_path, "many.yaml", "parallel:\n  tensr: 2\ncache:\n  block_size: 24\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: ")
    assert "parallel.tensr: unknown key" in msg
    assert "cache.block_size" in msg and "block_size=24" in msg
    assert "; " in msg


def test_wrong_type_names_key_and_value(tmp_path):
    p = write(tmp_path, "type.yaml", "parallel:\n  tensor: two\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: parallel.tensor: ")
    assert "valid integer" in msg
    assert "(got 'two')" in msg


def test_non_positive_int_names_key_and_value(tmp_path):
    p = write(tmp_path, "zero.yaml", "scheduler:\n  max_num_seqs: 0\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: scheduler.max_num_seqs: ")
    assert "greater than 0" in msg and "(got 0)" in msg


def test_boolean_for_an_integer_key_is_a_wrong_type(tmp_path):
    p = write(tmp_path, "bool.yaml", "parallel:\n  tensor: true\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: parallel.tensor: ")


def test_invalid_dtype_literal_lists_the_choices(tmp_path):
    p = write(tmp_path, "dtype.yaml", "model:\n  dtype: fp16\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: model.dtype: ")
    for choice in ("'auto'", "'float32'", "'bfloat16'", "'float16'"):
        assert choice in msg
    assert "(got 'fp16')" in msg


def test_invalid_device_literal(tmp_path):
    p = write(tmp_path, "dev.yaml", "device:\n  type: tpu\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: device.type: ") and "(got 'tpu')" in msg


@pytest.mark.parametrize("size", [3, 24, 48])
def test_block_size_not_a_power_of_two(tmp_path, size):
    p = write(tmp_path, "bs.yaml", f"cache:\n  block_size: {size}\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: cache.block_size: ")
    assert f"block_size={size} must be a power of two" in msg


@pytest.mark.parametrize("size", [1, 2, 16, 32, 256])
def test_block_size_power_of_two_is_accepted(size):
    assert load_config(None, [f"cache.block_size={size}"]).cache.block_size == size


def test_zmq_address_without_scheme(tmp_path):
    p = write(tmp_path, "zmq.yaml", "server:\n  zmq: 'http://127.0.0.1:5555'\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: server.zmq: ") and "tcp:// or ipc://" in msg


def test_unparsable_byte_size(tmp_path):
    p = write(tmp_path, "mem.yaml", "cache:\n  memory: lots\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: cache.memory: ") and "(got 'lots')" in msg


@pytest.mark.parametrize("item", ["parallel.tensor", "=3", "  =3"])
def test_malformed_override_without_key_or_equals(item):
    msg = load_error(None, [item])
    assert msg == f"{BUILTIN_SOURCE}: --set {item!r}: expected KEY=VALUE, e.g. --set parallel.tensor=2"


def test_malformed_override_names_the_config_file(tmp_path):
    p = write(tmp_path, "ok.yaml", "parallel:\n  tensor: 1\n")
    assert load_error(p, ["parallel.tensor"]).startswith(f"{p}: --set 'parallel.tensor': expected KEY=VALUE")


def test_override_with_invalid_yaml_value():
    msg = load_error(None, ["model.path=[unclosed"])
    assert msg.startswith(f"{BUILTIN_SOURCE}: --set 'model.path=[unclosed': value is not valid YAML")


def test_override_into_a_value_set_by_an_earlier_override():
    msg = load_error(None, ["parallel.tensor=2", "parallel.tensor.x=1"])
    assert msg == f"{BUILTIN_SOURCE}: --set 'parallel.tensor.x=1': parallel.tensor is a value, not a section"


def test_override_into_a_value_set_by_the_file(tmp_path):
    p = write(tmp_path, "sect.yaml", "model: 5\n")
    msg = load_error(p, ["model.dtype=float32"])
    assert msg == f"{p}: --set 'model.dtype=float32': model is a value, not a section"


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    p = write(tmp_path, "syntax.yaml", "parallel:\n  tensor: 2\nmodel: [unclosed\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: not valid YAML")
    assert "line 3" in msg


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just a string\n", "str"), ("42\n", "int")])
def test_top_level_not_a_mapping(tmp_path, text, kind):
    p = write(tmp_path, "top.yaml", text)
    assert load_error(p) == f"{p}: the top level must be a mapping of sections, got {kind}"


def test_section_that_is_not_a_mapping(tmp_path):
    p = write(tmp_path, "null.yaml", "parallel: 3\n")
    msg = load_error(p)
    assert msg.startswith(f"{p}: parallel: ") and "(got 3)" in msg


def test_missing_config_file(tmp_path):
    p = tmp_path / "nope.yaml"
    assert load_error(p) == f"{p}: no such config file"


def test_config_path_that_is_a_directory(tmp_path):
    assert load_error(tmp_path) == f"{tmp_path}: no such config file"


def test_empty_file_gives_the_defaults(tmp_path):
    p = write(tmp_path, "empty.yaml", "")
    assert load_config(p) == Config()


# ---------------------------------------------------------------- valid overrides


def test_override_sets_the_value():
    assert load_config(None, ["parallel.tensor=3"]).parallel.tensor == 3
    assert Config().parallel.tensor == 1


def test_later_override_wins_and_overrides_beat_the_file(tmp_path):
    p = write(tmp_path, "f.yaml", "parallel:\n  tensor: 9\n  pipeline: 2\nscheduler:\n  max_num_seqs: 8\n")
    c = load_config(p, ["parallel.tensor=2", "parallel.tensor=3", "scheduler.max_batched_tokens=512"])
    assert (c.parallel.tensor, c.parallel.pipeline) == (3, 2)
    assert (c.scheduler.max_num_seqs, c.scheduler.max_batched_tokens) == (8, 512)


def test_override_values_are_yaml():
    assert parse_override("parallel.tensor=3") == (["parallel", "tensor"], 3)
    key, value = parse_override("a.b=true")
    assert value is True and isinstance(value, bool)
    assert parse_override("a.b=no")[1] is False
    assert parse_override("a=null")[1] is None
    assert parse_override("a=1.5")[1] == 1.5
    assert parse_override("a='3'")[1] == "3"
    assert parse_override("a=") == (["a"], "")
    # Only the first '=' separates key and value; a URL keeps its colons.
    assert parse_override(" server.zmq = tcp://10.0.0.1:5555") == (["server", "zmq"], "tcp://10.0.0.1:5555")


def test_override_yaml_types_reach_the_config():
    c = load_config(None, ["cache.memory=512MiB", "server.http=null", "model.max_model_len=1024",
                           "model.path=builtin:smollm2-135m-instruct", "server.zmq=ipc:///tmp/x"])
    assert c.cache.memory == 512 * (1 << 20)
    assert c.server.http is None
    assert c.model.max_model_len == 1024 and isinstance(c.model.max_model_len, int)
    assert c.model.path == SMOLLM2
    assert c.server.zmq == "ipc:///tmp/x"


def test_file_values_parse_as_ints(tmp_path):
    p = write(tmp_path, "ints.yaml", "parallel:\n  tensor: 3\n  pipeline: 2\ncache:\n  num_blocks: 100\n")
    c = load_config(p)
    assert (c.parallel.tensor, c.parallel.pipeline, c.cache.num_blocks) == (3, 2, 100)
    assert c.world_size == 6
    assert all(type(v) is int for v in (c.parallel.tensor, c.parallel.pipeline, c.cache.num_blocks))


def test_config_is_frozen():
    c = load_config(None, [])
    with pytest.raises(Exception):
        c.parallel.tensor = 4  # type: ignore[misc]


# ---------------------------------------------------------------- checks against the model


def _suggested_sizes(msg: str) -> list[int]:
    m = re.search(r"\(try ([0-9, or]+)\)", msg)
    assert m, f"no suggested sizes in {msg!r}"
    return [int(x) for x in re.split(r", | or ", m.group(1))]


def test_tp_not_dividing_heads_smollm2_names_valid_sizes(smollm2, tmp_path):
    p = write(tmp_path, "tp2.yaml", f"model:\n  path: {SMOLLM2}\nparallel:\n  tensor: 2\n")
    msg = check_error(load_config(p), str(p))
    assert msg.startswith(f"{p}: parallel.tensor=2 does not divide num_attention_heads=9 (try 1 or 3)")
    assert ";" not in msg  # 2 divides the MLP's 1536: one problem only
    assert {1, 3} <= set(_suggested_sizes(msg)) <= {1, 3, 9}


def test_tp_not_dividing_heads_builtin_default_source(smollm2):
    msg = check_error(load_config(None, ["parallel.tensor=4"]), BUILTIN_SOURCE)
    assert msg.startswith(f"{BUILTIN_SOURCE}: parallel.tensor=4 does not divide num_attention_heads=9 (try 1 or 3)")


@pytest.mark.parametrize("tp", [2, 4])
def test_suggested_tp_sizes_are_accepted(smollm2, tp):
    msg = check_error(load_config(None, [f"parallel.tensor={tp}"]), BUILTIN_SOURCE)
    rejected = []
    for size in _suggested_sizes(msg):
        try:
            check_config(load_config(None, [f"parallel.tensor={size}"]))
        except ConfigError as e:
            rejected.append(str(e))
    assert not rejected, f"{msg!r} suggests sizes that fail: {rejected}"


@pytest.mark.parametrize("tp", [1, 3])
def test_valid_tp_sizes_pass_for_smollm2(smollm2, tp):
    info = check_config(load_config(None, [f"parallel.tensor={tp}"]))
    assert (info.num_attention_heads, info.num_key_value_heads) == (9, 3)


def test_tp_not_dividing_intermediate_size_smollm2(smollm2):
    msg = check_error(load_config(None, ["parallel.tensor=9"]), BUILTIN_SOURCE)
    assert msg == f"{BUILTIN_SOURCE}: parallel.tensor=9 does not divide intermediate_size=1536"


def test_sequence_parallelism_without_tensor_parallelism(smollm2):
    msg = check_error(load_config(None, ["parallel.sequence_parallel=true"]), BUILTIN_SOURCE)
    assert msg == (f"{BUILTIN_SOURCE}: parallel.sequence_parallel=true splits a step's tokens over the tensor-parallel "
                   "ranks, but parallel.tensor=1 (set parallel.tensor > 1, or sequence_parallel false)")
    check_config(load_config(None, ["parallel.sequence_parallel=true", "parallel.tensor=3"]))


def test_tp_not_dividing_intermediate_size_tiny(tiny_checkpoints, tmp_path):
    d = modified_checkpoint(tiny_checkpoints, tmp_path, intermediate_size=162)
    msg = check_error(load_config(None, [f"model.path={d}", "parallel.tensor=4"]), "mlp.yaml")
    assert msg == "mlp.yaml: parallel.tensor=4 does not divide intermediate_size=162"


def test_tp_not_dividing_heads_tiny(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  tensor: 3\n")
    msg = check_error(config, source)
    assert msg.startswith(f"{source}: parallel.tensor=3 does not divide num_attention_heads=4 (try 1, 2 or 4)")


def test_tp_above_kv_heads_replicates_them(tiny_checkpoints, tmp_path):
    # 4 heads, 2 KV heads: tp=4 is a multiple of the KV heads, so they are replicated.
    config, source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  tensor: 4\n")
    assert check_config(config, source).num_key_value_heads == 2


def test_tp_neither_dividing_nor_multiple_of_kv_heads(tiny_checkpoints, tmp_path):
    d = modified_checkpoint(tiny_checkpoints, tmp_path, hidden_size=96, intermediate_size=192, num_attention_heads=12,
                            num_key_value_heads=4)
    p = write(tmp_path, "tp6.yaml", f"model:\n  path: {d}\nparallel:\n  tensor: 6\n")
    msg = check_error(load_config(p), str(p))
    assert msg.startswith(f"{p}: parallel.tensor=6 neither divides num_key_value_heads=4")
    assert "nor is a multiple of it" in msg
    assert msg.endswith("(try 1, 2, 4 or 12)")


def test_pipeline_larger_than_layer_count(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  pipeline: 4\n")
    assert check_error(config, source) == f"{source}: parallel.pipeline=4 exceeds num_hidden_layers=3"


def test_pipeline_equal_to_layer_count_is_fine(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  pipeline: 3\n")
    assert check_config(config, source).num_hidden_layers == 3


def test_several_model_problems_in_one_message(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  tensor: 3\n  pipeline: 5\n")
    msg = check_error(config, source)
    assert msg.startswith(f"{source}: ")
    assert "parallel.tensor=3 does not divide num_attention_heads=4" in msg
    assert "parallel.pipeline=5 exceeds num_hidden_layers=3" in msg


def test_max_model_len_over_max_position_embeddings_message(tiny_checkpoints, tmp_path):
    p = write(tmp_path, "len.yaml", f"model:\n  path: {tiny_checkpoints['llama']}\n  max_model_len: 1024\n")
    msg = check_error(load_config(p), str(p))
    assert msg == f"{p}: model.max_model_len=1024 exceeds the model's max_position_embeddings=512"


def test_default_max_model_len_is_the_models_context(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "")
    info = check_config(config, source)
    assert plan_memory(config, info, source).max_model_len == 512


def test_kv_cache_too_small_for_max_model_len(tiny_checkpoints, tmp_path):
    # 3 layers x 2 KV heads x head_dim 16 x K,V x 4 bytes = 768 bytes per token; 32 KiB holds 42 tokens.
    config, source = tiny_config(tiny_checkpoints, tmp_path, "cache:\n  memory: 32KiB\n  block_size: 16\n")
    info = check_config(config, source)
    with pytest.raises(ConfigError) as e:
        plan_memory(config, info, source)
    msg = str(e.value)
    assert msg.startswith(f"{source}: the KV cache holds 2 blocks x 16 tokens = 32 tokens per rank")
    assert "fewer than model.max_model_len=512" in msg
    assert "cache.memory (now 32768 bytes, 768 bytes per token)" in msg


def test_kv_cache_too_small_with_fixed_num_blocks(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "cache:\n  num_blocks: 31\n  block_size: 16\n")
    with pytest.raises(ConfigError, match=r"cache.num_blocks=31 x cache.block_size=16 = 496 tokens per rank, "
                                          r"fewer than model.max_model_len=512; set cache.num_blocks >= 32"):
        plan_memory(config, check_config(config, source), source)


def test_kv_cache_too_small_with_fixed_num_blocks_suggests_num_blocks(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "cache:\n  num_blocks: 31\n  block_size: 16\n")
    with pytest.raises(ConfigError) as e:
        plan_memory(config, check_config(config, source), source)
    assert "cache.num_blocks" in str(e.value)


def test_kv_cache_exactly_max_model_len_is_enough(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "cache:\n  num_blocks: 32\n  block_size: 16\n")
    plan = plan_memory(config, check_config(config, source), source)
    assert (plan.num_blocks, plan.kv_cache_tokens, plan.kv_bytes_per_token) == (32, 512, 768)


def test_kv_per_token_counts_local_kv_heads_and_stage_layers(tiny_checkpoints, tmp_path):
    # tp=2 shards the 2 KV heads (1 each); pp=2 puts 2 of the 3 layers on the first stage.
    config, source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  tensor: 2\n  pipeline: 2\n")
    plan = plan_memory(config, check_config(config, source), source)
    assert plan.kv_bytes_per_token == 2 * 2 * 1 * 16 * 4
    # tp=4 > 2 KV heads: one replicated head per rank, not zero.
    config, source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  tensor: 4\n", name="tp4.yaml")
    assert plan_memory(config, check_config(config, source), source).kv_bytes_per_token == 2 * 3 * 1 * 16 * 4


def test_unknown_builtin_model(tmp_path):
    p = write(tmp_path, "b.yaml", "model:\n  path: builtin:gpt-5\n")
    msg = check_error(load_config(p), str(p))
    assert msg == f"{p}: model.path='builtin:gpt-5': unknown builtin model (known: smollm2-135m-instruct)"


def test_model_path_missing(tmp_path):
    missing = tmp_path / "no-such-model"
    p = write(tmp_path, "m.yaml", f"model:\n  path: {missing}\n")
    assert check_error(load_config(p), str(p)) == f"{p}: model.path={str(missing)!r} does not exist"


def test_model_path_directory_without_config_json(tmp_path):
    d = tmp_path / "empty-model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    msg = check_error(load_config(None, [f"model.path={d}"]), BUILTIN_SOURCE)
    assert msg == (f"{BUILTIN_SOURCE}: model.path={str(d)!r} is a directory without config.json "
                   f"(expected a Hugging Face checkpoint)")


def test_model_path_file_not_gguf(tmp_path):
    f = write(tmp_path, "weights.bin", "not a model")
    msg = check_error(load_config(None, [f"model.path={f}"]), "x.yaml")
    assert msg == f"x.yaml: model.path={str(f)!r} is a file but not .gguf (give a .gguf file or a Hugging Face directory)"


def test_unsupported_model_type(tiny_checkpoints, tmp_path):
    d = modified_checkpoint(tiny_checkpoints, tmp_path, model_type="gpt2")
    msg = check_error(load_config(None, [f"model.path={d}"]), "arch.yaml")
    assert msg.startswith("arch.yaml: ") and "model_type='gpt2' is not supported" in msg and "llama" in msg


def test_float16_on_cpu(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "device:\n  type: cpu\n")
    config = config.model_copy(update={"model": config.model.model_copy(update={"dtype": "float16"})})
    msg = check_error(config, source)
    assert msg == f"{source}: model.dtype=float16 is not supported on device.type=cpu (use float32 or bfloat16)"


def test_float16_from_file_on_cpu_and_fine_on_cuda(tiny_checkpoints, tmp_path):
    p = write(tmp_path, "fp16.yaml", f"model:\n  path: {tiny_checkpoints['llama']}\n  dtype: float16\n")
    assert "model.dtype=float16 is not supported on device.type=cpu" in check_error(load_config(p), str(p))
    cuda = load_config(p, ["device.type=cuda"])
    check_config(cuda, str(p))  # no torch needed: validation only
    assert cuda.torch_dtype_name == "float16"
    assert load_config(p, ["model.dtype=auto", "device.type=cuda"]).torch_dtype_name == "bfloat16"


def test_auto_dtype_is_bfloat16_where_the_cpu_has_bf16_dot_products(tiny_checkpoints):
    """`auto` takes bf16 with AMX or AVX512-BF16, float32 elsewhere (and where the flags are
    unknown), and says why; a dtype given or a quantization decides before the CPU does."""
    auto = load_config(None, [f"model.path={tiny_checkpoints['llama']}"])
    amx = CpuFeatures(frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}))
    zen4 = CpuFeatures(frozenset({"avx512f", "avx512_bf16"}))
    avx2 = CpuFeatures(frozenset({"avx2", "fma", "f16c"}))
    assert auto.dtype_on(amx) == ("bfloat16", "model.dtype=auto on a CPU with bf16 dot products (AMX); "
                                              "model.dtype=float32 computes in float32")
    assert auto.dtype_on(zen4)[0] == "bfloat16" and "AVX512-BF16" in auto.dtype_on(zen4)[1]
    assert auto.dtype_on(avx2) == ("float32", f"model.dtype=auto on a CPU without bf16 dot products "
                                              f"({avx2.describe()})")
    assert auto.dtype_on(CpuFeatures(frozenset(), known=False))[0] == "float32"
    pinned = load_config(None, [f"model.path={tiny_checkpoints['llama']}", "model.dtype=float32"])
    assert pinned.dtype_on(amx) == ("float32", "as model.dtype says")
    quantized = load_config(None, [f"model.path={tiny_checkpoints['llama']}", "model.quantization=int8"])
    assert quantized.dtype_on(avx2)[0] == "bfloat16"
    assert auto.torch_dtype_name == auto.dtype_on(cpu_features())[0]


# ---------------------------------------------------------------- the CLI


def test_check_prints_resolved_config_and_memory_plan(smollm2, capsys):
    assert main(["check", "--set", "model.max_model_len=1024"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    # The resolved config, as YAML, with defaults filled in and the override applied.
    assert "model:" in lines and "parallel:" in lines and "cache:" in lines
    assert f"  path: {SMOLLM2}" in lines
    assert "  max_model_len: 1024" in lines
    assert "  tensor: 1" in lines
    # SmolLM2-135M: 30 layers, 9 heads / 3 KV heads of dim 64, vocab 49152, tied embeddings.
    assert any(l.startswith("# model: llama (gguf) 30 layers, hidden 576, 9 heads / 3 KV heads") for l in lines)
    params = 49152 * 576 + 30 * (576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576
    dtype = load_config(None).torch_dtype_name  # the default's, as this CPU resolves `auto`
    size = {"float32": 4, "bfloat16": 2}[dtype]
    weights_mib = params * size / (1 << 20)
    kv_per_token = 2 * 30 * 3 * 64 * size
    blocks = (1 << 30) // (kv_per_token * 16)
    assert f"# memory plan per rank ({dtype}, world size 1):" in lines
    assert f"#   weights:           {weights_mib:.1f} MiB" in lines
    assert f"#   KV per token:      {kv_per_token} bytes" in lines
    assert f"#   KV cache:          {blocks} blocks x 16 tokens = {blocks * 16} tokens, " \
           f"{blocks * 16 * kv_per_token / (1 << 20):.1f} MiB" in lines
    assert "#   max_model_len:     1024" in lines


def test_check_memory_plan_follows_topology(smollm2, capsys):
    assert main(["check", "--set", "parallel.tensor=3", "--set", "cache.block_size=32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    dtype = load_config(None).torch_dtype_name
    kv_per_token = 2 * 30 * 1 * 64 * {"float32": 4, "bfloat16": 2}[dtype]  # 3 KV heads over tp=3: one per rank
    blocks = (1 << 30) // (kv_per_token * 32)
    assert f"# memory plan per rank ({dtype}, world size 3):" in lines
    assert f"#   KV per token:      {kv_per_token} bytes" in lines
    assert any(l.startswith(f"#   KV cache:          {blocks} blocks x 32 tokens = {blocks * 32} tokens") for l in lines)


def test_check_returns_2_on_bad_override(capsys):
    assert main(["check", "--set", "parallel.tensr=2"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err
    assert "parallel.tensr: unknown key" in err


def test_check_returns_2_on_model_mismatch(smollm2, capsys):
    assert main(["check", "--set", "parallel.tensor=2"]) == 2
    err = capsys.readouterr().err
    assert f"meshserve: config error: {BUILTIN_SOURCE}: parallel.tensor=2 does not divide num_attention_heads=9 " \
           f"(try 1 or 3)" in err


def test_check_returns_2_on_missing_file(tmp_path, capsys):
    p = tmp_path / "missing.yaml"
    assert main(["check", str(p)]) == 2
    captured = capsys.readouterr()
    assert f"config error: {p}: no such config file" in captured.err
    assert captured.out == ""


def test_check_returns_2_when_kv_cache_too_small(tiny_checkpoints, tmp_path, capsys):
    p = write(tmp_path, "small.yaml", f"model:\n  path: {tiny_checkpoints['llama']}\ncache:\n  num_blocks: 2\n")
    assert main(["check", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"config error: {p}: cache.num_blocks=2 x cache.block_size=16 = 32 tokens per rank" in err


def test_check_tiny_file_succeeds(tiny_checkpoints, tmp_path, capsys):
    p = write(tmp_path, "ok.yaml", f"model:\n  path: {tiny_checkpoints['llama']}\n  dtype: float32\ncache:\n"
                                   f"  num_blocks: 40\n")
    assert main(["check", str(p)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "#   KV per token:      768 bytes" in lines
    assert any(l.startswith("#   KV cache:          40 blocks x 16 tokens = 640 tokens") for l in lines)
    assert "#   max_model_len:     512" in lines


# ---------------------------------------------------------------- pipeline partitions


def test_pipeline_layers_not_summing_to_the_layer_count(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path,
                                 "parallel:\n  pipeline: 2\n  pipeline_layers: [1, 1]\n")
    msg = check_error(config, source)
    assert "parallel.pipeline_layers=[1, 1] sums to 2, not num_hidden_layers=3" in msg


def test_pipeline_layers_one_entry_per_stage(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  pipeline: 2\n  pipeline_layers: [3]\n")
    assert "parallel.pipeline_layers has 1 entries [3], one per stage needed (parallel.pipeline=2)" in \
        check_error(config, source)


def test_pipeline_layers_must_be_positive(tmp_path):
    p = write(tmp_path, "zero.yaml", "parallel:\n  pipeline: 2\n  pipeline_layers: [3, 0]\n")
    with pytest.raises(ConfigError, match=r"parallel.pipeline_layers.1: Input should be greater than 0"):
        load_config(p)


def test_bad_partition_fails_before_any_rank_starts(smollm2, capsys):
    assert main(["serve", "--set", "parallel.pipeline=2", "--set", "parallel.pipeline_layers=[10, 10]"]) == 2
    assert "parallel.pipeline_layers=[10, 10] sums to 20, not num_hidden_layers=30" in capsys.readouterr().err


def test_several_nodes_without_a_secret_are_refused_before_any_rank_starts(tiny_checkpoints, tmp_path, monkeypatch,
                                                                            capsys):
    monkeypatch.delenv("MESHSERVE_SECRET", raising=False)
    body = "parallel:\n  tensor: 2\n  pipeline: 2\ncluster:\n  nodes: 2\n  master_addr: 10.0.0.1\n"
    config, source = tiny_config(tiny_checkpoints, tmp_path, body, name="two.yaml")
    assert check_error(config, source) == (
        f"{source}: cluster.nodes=2 without server.secret: the control plane between the nodes would be plain TCP, "
        f"so whoever reaches the driver's ports reads every prompt and can forge step results; set server.secret "
        f"(or the environment variable MESHSERVE_SECRET) to the same long random value on every node, which "
        f"encrypts it (CURVE), or set cluster.insecure_control_plane=true on a private network you trust")
    # `meshserve serve --node-rank 0` stops there, before starting any rank
    assert main(["serve", source, "--node-rank", "0"]) == 2
    assert "config error" in (err := capsys.readouterr().err) and "set server.secret" in err
    # a secret (in the file, or from the environment as the launcher fills it in), or the opt-out
    check_config(load_config(Path(source), ["server.secret=a-long-random-secret"]), source)
    check_config(load_config(Path(source), ["cluster.insecure_control_plane=true"]), source)
    monkeypatch.setenv("MESHSERVE_SECRET", "from-the-environment")
    assert main(["check", source]) == 0
    # one node needs neither: its control plane is unix sockets in a private directory
    one, one_source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  tensor: 2\n  pipeline: 2\n", name="one.yaml")
    monkeypatch.delenv("MESHSERVE_SECRET")
    check_config(one, one_source)


def test_disaggregation_needs_a_decode_replica_and_no_context_parallelism(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  data: 2\n  context: 2\n"
                                 "disaggregation:\n  prefill_replicas: 2\n")
    message = check_error(config, source)
    assert "disaggregation.prefill_replicas=2 leaves no decode replica of parallel.data=2 (at most 1)" in message
    assert "with parallel.context=2" in message
    config, source = tiny_config(tiny_checkpoints, tmp_path, "parallel:\n  data: 2\n"
                                 "disaggregation:\n  prefill_replicas: 1\n", name="ok.yaml")
    check_config(config, source)


def test_a_replica_that_joins_a_router_needs_the_secret_and_is_one_replica(tiny_checkpoints, tmp_path):
    config, source = tiny_config(tiny_checkpoints, tmp_path, "router:\n  join: tcp://10.0.0.1:5560\n"
                                                              "  heartbeat_interval: 2\n  heartbeat_timeout: 1\n"
                                                              "parallel:\n  data: 2\n")
    message = check_error(config, source)
    assert "router.join=tcp://10.0.0.1:5560 needs server.secret" in message
    assert "router.join with parallel.data=2: a replica that joins a router is one replica" in message
    assert "router.heartbeat_timeout=1 must exceed router.heartbeat_interval=2" in message
    config, source = tiny_config(tiny_checkpoints, tmp_path, "router:\n  join: tcp://10.0.0.1:5560\n"
                                                              "server:\n  secret: a-long-random-secret-value\n",
                                 name="ok.yaml")
    check_config(config, source)
