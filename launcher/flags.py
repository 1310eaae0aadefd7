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
    Flag(("-dp", "--data-parallel-size"), "parallel.data", int, "replicas behind one front door"),
    Flag(("--max-num-seqs",), "scheduler.max_num_seqs", int, "most sequences in one step"),
    Flag(("--served-model-name",), "server.model_name", str, "the model's name in the HTTP API"),
    Flag(("--reasoning-parser",), "server.reasoning_parser", str, "split replies' reasoning off as "
                                                                  "reasoning_content: qwen3 or deepseek_r1"),
    Flag(("-md", "--model-draft"), "speculative.model", str, "a draft model for speculative decoding "
                                                             "(llama-server's flag; implies speculative.method=draft)"),
    Flag(("--draft-max", "--draft"), "speculative.num_speculative_tokens", int, "most tokens a sequence proposes per step"),
    Flag(("--max-loras",), "lora.max_loras", int, "LoRA adapters resident at once"),
    Flag(("--max-lora-rank",), "lora.max_rank", int, "the highest LoRA rank served"),
)
"""Each sets one config key; --host, --port, --api-key, --speculative-config, --enable-lora and
--lora-modules are handled below."""

SPECULATIVE_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                    "quantization", "dtype", "draft_memory", "adaptive"}
"""vLLM's --speculative-config keys this server takes (the speculative section's)."""
SPECULATIVE_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft", "none": "none"}


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
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative decoding settings, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 5}' [the speculative section's keys]")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters, loaded now or at run time [lora.enabled, default: false]")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve from the start, as NAME=PATH or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ...}' [lora.adapters; implies --enable-lora]")


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
    if args.speculative_config is not None:
        values.update(speculative_values(args.speculative_config))
    if values.get("speculative.model") and "speculative.method" not in values:
        values["speculative.method"] = "draft"
    if args.enable_lora:
        values["lora.enabled"] = True
    if args.lora_modules:
        values["lora.adapters"] = lora_modules(args.lora_modules)
        values["lora.enabled"] = True
    # NOTE: JSON is YAML: a path or name like `on` or `1e3` stays a string
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def lora_modules(items: list[str]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... (or vLLM's JSON objects with name and path) -> lora.adapters."""
    adapters = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"--lora-modules {item!r}: a JSON module has \"name\" and \"path\"") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {item!r}: expected NAME=PATH")
        adapters[name] = path
    return adapters


def speculative_values(text: str) -> dict[str, object]:
    """vLLM's --speculative-config JSON as speculative.* config keys (its method names
    included; a model without a method is a draft model)."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config: not JSON ({e.msg} at character {e.pos}): {text}") from None
    if not isinstance(given, dict):
        raise ConfigError(f"--speculative-config: a JSON object expected, got {text}")
    unknown = sorted(set(given) - SPECULATIVE_KEYS)
    if unknown:
        raise ConfigError(f"--speculative-config: {', '.join(unknown)} not supported here; "
                          f"the keys are {', '.join(sorted(SPECULATIVE_KEYS))}")
    values = {f"speculative.{key}": value for key, value in given.items()}
    method = given.get("method", "draft" if given.get("model") else None)
    if method is not None:
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative-config: method {method!r}: expected one of "
                              f"{', '.join(SPECULATIVE_METHODS)}")
        values["speculative.method"] = SPECULATIVE_METHODS[method]
    return values


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
