"""The `meshserve` command: serve, generate, check.

Every command loads and validates the config (and checks it against the model) before
anything heavy starts, so mistakes fail in a second with the numbers in the message.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import yaml

from meshserve.configs import ConfigError, load_config
from meshserve.configs.memory import MemoryPlan, plan_memory
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.schema import Config
from meshserve.configs.validate import check_config


def _add_config_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("config", nargs=None if required else "?", help="YAML config (default: the built-in SmolLM2 on CPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallel.tensor=2 (repeatable)")
    # Set by `meshserve serve`/`generate` on the ranks they start: run as one rank of the launcher's world.
    p.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description="Distributed LLM serving runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve a model over ZMQ (and HTTP)")
    _add_config_args(p, required=False)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT")

    p = sub.add_parser("worker", help="one rank, under torchrun / mpirun / the deepspeed launcher")
    _add_config_args(p, required=False)
    p.add_argument("--drain-timeout", type=float, default=30.0, help=argparse.SUPPRESS)

    p = sub.add_parser("generate", help="offline batch generation through the same engine")
    _add_config_args(p, required=False)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (text, token_ids)")

    p = sub.add_parser("check", help="validate a config and print the resolved config and memory plan")
    _add_config_args(p, required=False)
    return parser


def load(args: argparse.Namespace) -> tuple[Config, ModelInfo, MemoryPlan]:
    source = args.config or "<builtin default>"
    config = load_config(args.config, args.overrides)
    info = check_config(config, source)
    return config, info, plan_memory(config, info, source)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def cmd_check(args: argparse.Namespace) -> int:
    config, info, memory = load(args)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False).rstrip())
    print(f"# model: {info.architecture} ({info.format}) {info.num_hidden_layers} layers, hidden {info.hidden_size}, "
          f"{info.num_attention_heads} heads / {info.num_key_value_heads} KV heads, vocab {info.vocab_size}, "
          f"{info.num_parameters / 1e6:.1f}M parameters")
    print(f"# memory plan per rank ({memory.dtype}, world size {config.world_size}):")
    print(f"#   weights:           {_mib(memory.weight_bytes)}")
    print(f"#   KV per token:      {memory.kv_bytes_per_token} bytes")
    print(f"#   KV cache:          {memory.num_blocks} blocks x {memory.block_size} tokens = "
          f"{memory.kv_cache_tokens} tokens, {_mib(memory.kv_cache_bytes)}")
    print(f"#   max_model_len:     {memory.max_model_len}")
    return 0


def _run(args: argparse.Namespace, mode_factory) -> int:
    """Validate, then: world size 1 -> this process is the rank; `--as-rank` -> this process
    is one rank of a launcher's world; otherwise start this node's ranks."""
    config, info, memory = load(args)
    if args.as_rank:
        from meshserve.launcher.env import rank_env_from_environ
        from meshserve.launcher.rank import run_rank

        return run_rank(config, info, memory, rank_env_from_environ(), mode_factory())
    if config.world_size == 1:
        from meshserve.launcher.env import RankEnv
        from meshserve.launcher.rank import run_rank

        return run_rank(config, info, memory, RankEnv(), mode_factory())
    from meshserve.launcher.spawn import spawn_local_ranks

    return spawn_local_ranks(config, ["-m", "meshserve.launcher.cli", *args.argv, "--as-rank"],
                             shutdown_timeout=getattr(args, "drain_timeout", 30.0) + 15)


def _serve_mode(args):
    from meshserve.launcher.serve import ServeMode

    return lambda: ServeMode(args.drain_timeout)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        return _run(args, _serve_mode(args))
    except OSError as e:  # e.g. the ZMQ or HTTP address is taken
        print(f"meshserve: {e}", file=sys.stderr)
        return 1


def cmd_worker(args: argparse.Namespace) -> int:
    args.as_rank = True
    return cmd_serve(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from meshserve.comm.messages import SamplingParams
    from meshserve.launcher.generate import GenerateMode

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    return _run(args, lambda: GenerateMode(args.prompt, params, args.chat, args.json))


COMMANDS = {"serve": cmd_serve, "worker": cmd_worker, "generate": cmd_generate, "check": cmd_check}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"meshserve: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
