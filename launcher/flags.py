"""The flags users of `vllm serve` and `llama-server` type, as config overrides.

`meshserve serve MODEL` takes a model (a .gguf file or a Hugging Face directory) where a
config file would go, and `--port 8080 -tp 2 --max-model-len 4096` mean what they mean to
vLLM: each flag is one config key (the table below), applied after the config file and
before `--set`, so an explicit `--set` still has the last word.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from meshserve.configs import ConfigError
from meshserve.configs.schema import Config

CONFIG_SUFFIXES = (".yaml", ".yml")

DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "half": "float16", "fp16": "float16"}
"""--dtype values (vLLM's spellings included) -> model.dtype."""


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    key: str
    """The config key it sets."""
    type: type
    help: str


FLAGS = (
    Flag(("-m", "--model"), "model.path", str, "model: a .gguf file or a Hugging Face directory (as the positional)"),
    Flag(("--dtype",), "model.dtype", str, f"activations' dtype: {', '.join(DTYPES)}"),
    Flag(("--max-model-len",), "model.max_model_len", int, "most tokens of a sequence (prompt + output)"),
    Flag(("-tp", "--tensor-parallel-size"), "parallel.tensor", int, "tensor-parallel ranks"),
    Flag(("-pp", "--pipeline-parallel-size"), "parallel.pipeline", int, "pipeline stages"),
    Flag(("--max-num-seqs",), "scheduler.max_num_seqs", int, "most sequences in one step"),
    Flag(("--served-model-name",), "server.model_name", str, "the model's name in the HTTP API"),
)
"""Each sets one config key; --host, --port and --api-key are handled below."""


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("common flags (vLLM's and llama-server's names; each sets the config key named, "
                             "whose default is shown)")
    defaults = Config().model_dump(mode="json")
    for flag in FLAGS:
        section, key = flag.key.split(".")
        default = defaults[section][key]
        g.add_argument(*flag.names, dest=_dest(flag), type=flag.type, default=None, metavar=key.upper(),
                       help=f"{flag.help} [{flag.key}, default: {'from the model' if default is None else default}]")
    host, _, port = defaults["server"]["http"].rpartition(":")
    g.add_argument("--host", default=None, help=f"HTTP host [the host of server.http, default: {host}]")
    g.add_argument("--port", type=int, default=None, help=f"HTTP port [the port of server.http, default: {port}]")
    g.add_argument("--api-key", default=None,
                   help="key HTTP clients must send [server.api_key; the ranks get it as MESHSERVE_API_KEY]")


def _dest(flag: Flag) -> str:
    return "flag_" + flag.key.replace(".", "_")


def split_target(target: str | None, config: str | None) -> tuple[str | None, str | None]:
    """The positional argument of serve/generate/check/worker -> (config file, model path):
    a .yaml/.yml file is a config, anything else (a .gguf file, a directory) a model."""
    if target is None:
        return config, None
    if target.endswith(CONFIG_SUFFIXES):
        if config is not None:
            raise ConfigError(f"two config files: {target} and --config {config}")
        return target, None
    p = Path(target).expanduser()
    if p.is_file() and not target.endswith(".gguf") and not _is_text(p):
        raise ConfigError(f"{target}: neither a YAML config (.yaml, .yml) nor a GGUF model (.gguf)")
    return config, target


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    try:
        head.decode()
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


def overrides(args: argparse.Namespace, model: str | None) -> list[str]:
    """The --set overrides the flags stand for (server.http's are added by `http_override`)."""
    values = {"model.path": model} if model is not None else {}
    for flag in FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None:
            values[flag.key] = value
    if "model.dtype" in values:
        if values["model.dtype"] not in DTYPES:
            raise ConfigError(f"--dtype {values['model.dtype']}: expected one of {', '.join(DTYPES)}")
        values["model.dtype"] = DTYPES[values["model.dtype"]]
    if args.api_key is not None:
        values["server.api_key"] = args.api_key
    # NOTE: JSON is YAML: a path or name like `on` or `1e3` stays a string
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def without_api_key(argv: list[str]) -> list[str]:
    """`argv` less --api-key and its value: the ranks a launcher starts get the key in their
    environment (MESHSERVE_API_KEY) rather than on a command line anyone can list."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--api-key":
            skip = True
        elif not item.startswith("--api-key="):
            out.append(item)
    return out


def http_override(args: argparse.Namespace, http: str | None) -> list[str]:
    """server.http with --host and/or --port replacing its parts (default 127.0.0.1:8000)."""
    if args.host is None and args.port is None:
        return []
    host, _, port = (http or "127.0.0.1:8000").rpartition(":")
    return [f"server.http={args.host or host}:{args.port if args.port is not None else port}"]
