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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description="Distributed LLM serving runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve a model over ZMQ (and HTTP)")
    _add_config_args(p, required=False)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT")

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


def _require_single_rank(config: Config) -> None:
    if config.world_size != 1:
        raise ConfigError(f"world size {config.world_size} (tensor={config.parallel.tensor}, "
                          f"pipeline={config.parallel.pipeline}, context={config.parallel.context}): this build "
                          f"runs one rank only; set parallel.tensor/pipeline/context to 1")


def cmd_serve(args: argparse.Namespace) -> int:
    config, info, memory = load(args)
    _require_single_rank(config)
    from meshserve.launcher.serve import serve_single_rank

    try:
        return serve_single_rank(config, info, memory, args.drain_timeout)
    except OSError as e:  # e.g. the ZMQ or HTTP address is taken
        print(f"meshserve: {e}", file=sys.stderr)
        return 1


def cmd_generate(args: argparse.Namespace) -> int:
    config, info, memory = load(args)
    _require_single_rank(config)
    from meshserve.comm.messages import SamplingParams
    from meshserve.engine.bootstrap import build_single_rank_engine
    from meshserve.engine.offline import generate
    from meshserve.engine.validation import RequestError
    from meshserve.launcher.env import cpu_threads

    engine = build_single_rank_engine(config, info, memory, threads=cpu_threads(config.device.threads, 1))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
               for p in args.prompt]
    try:
        results = generate(engine, prompts, params)
    except RequestError as e:
        print(f"meshserve: bad request: {e.message}", file=sys.stderr)
        return 1
    for prompt, result in zip(args.prompt, results):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": result.text, "token_ids": result.token_ids,
                              "finish_reason": result.finish_reason}), flush=True)
        else:
            print(result.text, flush=True)
    return 0


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "check": cmd_check}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"meshserve: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
