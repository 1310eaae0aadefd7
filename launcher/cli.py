"""The `meshserve` command: serve, router, worker, generate, check, bench, advise, admin.

Every command loads and validates the config (and checks it against the model) before
anything heavy starts, so mistakes fail in a second with the numbers in the message.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version

import yaml

from meshserve.configs import ConfigError, load_config
from meshserve.configs.memory import MemoryPlan, plan_memory
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.schema import Config, redacted
from meshserve.configs.validate import check_config, exposure_warnings
from meshserve.launcher import flags
from meshserve.launcher.env import admin_key_from_environ, api_key_from_environ, export_api_key, secrets_from_environ
from meshserve.launcher.errors import StartupError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, but not one that says nothing (None, an empty list, off)."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, [], False) else super()._get_help_string(action)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", metavar="CONFIG_OR_MODEL",
                   help="a YAML config (.yaml, .yml), or a model to serve with the defaults: a .gguf file or a "
                        "Hugging Face directory (default: the built-in SmolLM2 on CPU)")
    p.add_argument("--config", default=None, metavar="FILE.yaml", help="a YAML config, beside a model given as "
                                                                      "CONFIG_OR_MODEL")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallel.tensor=2 (repeatable; applied last)")
    p.add_argument("--node-rank", type=int, default=None, metavar="K",
                   help="this node's rank, 0 .. cluster.nodes-1, when the config spans several nodes")
    # Set by `meshserve serve`/`generate` on the ranks they start: run as one rank of the launcher's world.
    p.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    # ... and the launcher's pid, which the ranks must not outlive (launcher/lifetime.py).
    p.add_argument("--launcher-pid", type=int, default=None, help=argparse.SUPPRESS)
    flags.add_flags(p)


def _version() -> str:
    try:
        return version("meshserve")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


class _SubParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=HelpFormatter, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description="Distributed LLM serving runtime")
    parser.add_argument("--version", action="version", version=f"meshserve {_version()}")
    # deepspeed's launcher (and torch.distributed.launch) put --local_rank=N before the command;
    # the rank reads LOCAL_RANK from the environment instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubParser)

    p = sub.add_parser("serve", help="serve a model over ZMQ (and HTTP)")
    _add_config_args(p)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT")

    p = sub.add_parser("router", help="a front door alone: replicas started by any launcher join it (router.join)")
    _add_config_args(p)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT")

    p = sub.add_parser("worker", help="one rank, under torchrun / mpirun / the deepspeed launcher")
    _add_config_args(p)
    p.add_argument("--drain-timeout", type=float, default=30.0, help=argparse.SUPPRESS)

    p = sub.add_parser("generate", help="offline batch generation through the same engine")
    _add_config_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (text, token_ids)")

    p = sub.add_parser("run-batch", help="answer a Batch API input file (OpenAI's JSONL) offline, as vLLM's "
                                         "run-batch does")
    _add_config_args(p)
    p.add_argument("-i", "--input-file", required=True, metavar="IN.jsonl",
                   help="requests, one per line: {custom_id, method: POST, url, body}")
    p.add_argument("-o", "--output-file", required=True, metavar="OUT.jsonl",
                   help="answers, one per line: {id, custom_id, response: {status_code, request_id, body}, error}")
    p.add_argument("--drain-timeout", type=float, default=30.0, help=argparse.SUPPRESS)

    p = sub.add_parser("check", help="validate a config and print the resolved config and memory plan")
    _add_config_args(p)

    p = sub.add_parser("advise", help="measure the dtype and quantization paths on this machine and say which "
                                      "serves one stream and batches fastest (recorded for model.quantization=auto)")
    _add_config_args(p)
    p.add_argument("--no-record", action="store_true", help="print the advice without recording it")

    _add_bench_parser(sub)
    from meshserve.client.admin import add_parser as add_admin_parser  # client-side code: httpx, no torch

    add_admin_parser(sub, admin_key_from_environ)
    return parser


def _add_bench_parser(sub) -> None:
    """Flags as in vLLM's serving benchmark (`vllm bench serve`)."""
    p = sub.add_parser("bench", help="load-test any OpenAI-compatible server (TTFT, TPOT, ITL, goodput)")
    p.add_argument("--url", required=True, help="server base URL (e.g. http://127.0.0.1:8000) or full endpoint URL")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server serves: each request names one of them as its model, at random "
                        "(--seed), as vLLM's benchmark does")
    p.add_argument("--api-key", default=None,
                   help="sent as `Authorization: Bearer KEY` (default: $MESHSERVE_API_KEY, if set)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[None], metavar="C",
                   help="most requests in flight (several values: a sweep)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")], metavar="R",
                   help="requests/s, Poisson arrivals (default inf: all at once; several values: a sweep)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, lower is burstier")
    p.add_argument("--dataset-name", choices=["random", "prefix-repetition", "prefix_repetition", "multi-turn"],
                   default="random", help="random prompts; groups sharing a long prefix (--num-prefixes, "
                   "--prefix-len, --suffix-len); or conversations of --num-turns turns, each resending its history "
                   "plus a new question of --input-len tokens (--num-prompts conversations)")
    p.add_argument("--num-prefixes", "--prefix-repetition-num-prefixes", dest="num_prefixes", type=int, default=4)
    p.add_argument("--prefix-len", "--prefix-repetition-prefix-len", dest="prefix_len", type=int, default=1024)
    p.add_argument("--suffix-len", "--prefix-repetition-suffix-len", dest="suffix_len", type=int, default=128)
    p.add_argument("--num-turns", type=int, default=8)
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128)
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    p.add_argument("--dataset", "--dataset-path", dest="dataset", default=None, metavar="FILE.jsonl",
                   help="prompts from a JSONL file: {\"prompt\": ..., \"output_len\": N} per line")
    p.add_argument("--prompt-format", choices=["text", "tokens"], default="text",
                   help="random prompts as text (calibrated on the server's token counts) or as token ids")
    p.add_argument("--slo", "--goodput", dest="slo", nargs="+", default=None, metavar="KEY=MS",
                   help="goodput SLOs in ms, e.g. ttft=2000,tpot=100 (keys: ttft, tpot, e2el)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None, help="sent as top_p (default: not sent)")
    p.add_argument("--top-k", type=int, default=None, help="sent as top_k (default: not sent)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so every request generates --output-len tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--output", "--result-filename", dest="output", default=None, metavar="FILE.json",
                   help="write the result as JSON, and PNG plots next to it")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")


def load(args: argparse.Namespace) -> tuple[Config, ModelInfo, MemoryPlan]:
    path, model = flags.split_target(args.target, args.config)
    source = path or "<builtin default>"
    base = flags.overrides(args, model)
    config = load_config(path, base + args.overrides)
    http = flags.http_override(args, config.server.http)
    if http:
        config = load_config(path, base + http + args.overrides)
    config = secrets_from_environ(config)
    for warning in [] if args.as_rank else exposure_warnings(config):  # said once, by the launching process
        logging.getLogger("meshserve").warning("%s", warning)
    logging.getLogger("meshserve").info("checking the config against the model (%s)", config.model.path)
    info = check_config(config, source)
    return config, info, plan_memory(config, info, source)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def cmd_check(args: argparse.Namespace) -> int:
    config, info, memory = load(args)
    data = redacted(config)
    resolved = []
    if data["model"]["max_model_len"] is None:
        data["model"]["max_model_len"] = memory.max_model_len
        resolved.append("model.max_model_len")
    print(yaml.safe_dump(data, sort_keys=False).rstrip())
    if resolved:
        print(f"# resolved from the model and the memory plan: {', '.join(resolved)}")
    print(f"# model: {info.architecture} ({info.format}) {info.num_hidden_layers} layers, hidden {info.hidden_size}, "
          f"{info.num_attention_heads} heads / {info.num_key_value_heads} KV heads, vocab {info.vocab_size}, "
          f"{info.num_parameters / 1e6:.1f}M parameters")
    if info.moe is not None:
        m = info.moe
        print(f"# experts: {m.num_experts} per MoE layer ({len(m.sparse_layers)} of {info.num_hidden_layers} layers), "
              f"top {m.num_experts_per_tok}, {m.num_experts // config.parallel.expert} per rank "
              f"(parallel.expert={config.parallel.expert}); {info.num_active_parameters / 1e6:.1f}M active "
              f"parameters per token (what MFU/MBU count)")
    print(f"# memory plan per rank ({memory.dtype}, world size {config.world_size}):")
    print(f"#   weights:           {_mib(memory.weight_bytes)}")
    print(f"#   KV per token:      {memory.kv_bytes_per_token} bytes")
    print(f"#   KV cache:          {memory.num_blocks} blocks x {memory.block_size} tokens = "
          f"{memory.kv_cache_tokens} tokens, {_mib(memory.kv_cache_bytes)}")
    if memory.lora_bytes:
        print(f"#   LoRA slots:        {_mib(memory.lora_bytes)} ({config.lora.max_loras} adapters of rank "
              f"<= {config.lora.max_rank}, lora.max_loras and lora.max_rank)")
    print(f"#   max_model_len:     {memory.max_model_len}")
    if config.parallel.data > 1:
        print(f"# replicas: {config.parallel.data} (parallel.data), each {config.world_size} rank(s) as above, "
              f"{config.total_ranks} ranks in all, routed {config.router.policy}")
        if config.disaggregation.enabled:
            d = config.disaggregation
            print(f"# disaggregated: replicas 0..{d.prefill_replicas - 1} prefill, {d.prefill_replicas}.."
                  f"{config.parallel.data - 1} decode (KV sent layer by layer)")
    return 0


def _run(args: argparse.Namespace, mode_factory) -> int:
    """Validate, then: world size 1 -> this process is the rank; `--as-rank` -> this process
    is one rank of a launcher's world; otherwise start this node's ranks."""
    config, info, memory = load(args)
    if config.parallel.data > 1:
        if args.as_rank:
            raise StartupError(f"parallel.data={config.parallel.data} under a launcher's world: start the replicas "
                               f"with `meshserve serve`, which launches each apart so that one failing does not "
                               f"end the others (under torchrun, one rank's failure stops every rank of the node)")
        if args.command != "serve":
            raise ConfigError(f"parallel.data={config.parallel.data}: `meshserve {args.command}` runs one replica "
                              f"(set parallel.data=1); `meshserve serve` starts several behind one front door")
        from meshserve.launcher.serve_replicas import serve_replicas

        if args.api_key is not None:
            export_api_key(args.api_key)
        return serve_replicas(config, info, memory, args.argv, getattr(args, "drain_timeout", 30.0), args.node_rank,
                              check_sets=lambda sets: _check_replica_sets(args, sets))
    if args.as_rank:
        from meshserve.launcher.env import rank_env_from_environ
        from meshserve.launcher.lifetime import die_with_launcher
        from meshserve.launcher.rank import run_rank

        die_with_launcher(args.launcher_pid)
        return run_rank(config, info, memory, rank_env_from_environ(config.cluster), mode_factory())
    if config.world_size == 1:
        from meshserve.launcher.env import RankEnv
        from meshserve.launcher.rank import run_rank

        return run_rank(config, info, memory, RankEnv(), mode_factory())
    from meshserve.launcher.spawn import spawn_local_ranks

    if args.api_key is not None:
        export_api_key(args.api_key)
    return spawn_local_ranks(config, ["-m", "meshserve.launcher.cli", *flags.without_api_key(args.argv), "--as-rank",
                                     "--launcher-pid", str(os.getpid())],
                             shutdown_timeout=getattr(args, "drain_timeout", 30.0) + 15, node_rank=args.node_rank)


def _check_replica_sets(args: argparse.Namespace, sets: list[str]) -> None:
    """The admin API's overrides for one replica, checked as the replica will load them
    (ConfigError, a ValueError, names what is wrong)."""
    path, model = flags.split_target(args.target, args.config)
    config = load_config(path, flags.overrides(args, model) + args.overrides + list(sets) + ["parallel.data=1"])
    check_config(config, path or "<builtin default>")


def _serve_mode(args):
    from meshserve.launcher.serve import ServeMode

    return lambda: ServeMode(args.drain_timeout)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        return _run(args, _serve_mode(args))
    except OSError as e:  # e.g. the ZMQ or HTTP address is taken
        print(f"meshserve: {e}", file=sys.stderr)
        return 1


def cmd_router(args: argparse.Namespace) -> int:
    from meshserve.launcher.router import serve_router

    config, info, memory = load(args)
    try:
        return serve_router(config, info, memory, args.drain_timeout)
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


def cmd_run_batch(args: argparse.Namespace) -> int:
    from meshserve.launcher.run_batch import RunBatchMode, private_settings

    workdir = None
    if not args.as_rank:  # the ranks it starts get the same settings through their arguments
        settings, workdir = private_settings()
        for setting in settings:
            args.overrides.append(setting)
            args.argv = [*args.argv, "--set", setting]
    return _run(args, lambda: RunBatchMode(args.input_file, args.output_file, workdir, args.drain_timeout))


def cmd_bench(args: argparse.Namespace) -> int:
    from meshserve.client.bench import run  # client-side code: httpx, no torch

    if args.api_key is None:
        args.api_key = api_key_from_environ()
    args.dataset_name = args.dataset_name.replace("_", "-")  # vLLM spells it prefix_repetition
    return run(args)


def cmd_advise(args: argparse.Namespace) -> int:
    from meshserve.engine.advisor import advise, report

    config, _, _ = load(args)
    if config.device.type != "cpu":
        print(f"device.type={config.device.type}: the paths advise measures are the CPU's; on CUDA use "
              f"model.dtype=bfloat16 (model.quantization=auto does)")
        return 0
    advice = advise(config, progress=lambda line: print(line, file=sys.stderr, flush=True),
                    write=not args.no_record)
    print(report(advice))
    return 0


def cmd_admin(args: argparse.Namespace) -> int:
    from meshserve.client.admin import run

    return run(args)


COMMANDS = {"admin": cmd_admin, "router": cmd_router, "serve": cmd_serve, "worker": cmd_worker, "generate": cmd_generate, "check": cmd_check,
            "advise": cmd_advise, "bench": cmd_bench, "run-batch": cmd_run_batch}


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
    except StartupError as e:
        print(f"meshserve: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
