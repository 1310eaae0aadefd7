"""Eager decode while the decode step compiles in the background (device.compile=true,
device.compile_wait=false): one stream's decode tok/s with no compile at all, then in an
engine whose compile thread runs, request after request (each prompt new) until the graphs
are ready or --serve-seconds have passed (the compile then finishes idle), then compiled. Prints the medians, the share of eager speed kept during the
compile, and how long the compile took while serving; writes JSON.

The compile runs only while no step is served (engine/compile_throttle.py); --no-throttle
runs it as before that, free to take the GIL and the cores from the steps.

    python scripts/bench_background_compile.py [--config configs/smollm2-cpu-w8a8.yaml] [--set KEY=VALUE]
        [--output-len 32] [--no-throttle]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench_offline import make_prompts, run_meshserve
from meshserve.configs import load_config
from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine import compile_throttle
from meshserve.engine.build import build_single_rank_engine


def build(path: str | None, overrides: list[str], compile_decode: bool, threads: int):
    config = load_config(path, ["model.max_model_len=1024", *overrides, f"device.compile={compile_decode}",
                                "device.compile_wait=false"])
    info = check_config(config)
    return config, build_single_rank_engine(config, info, plan_memory(config, info), threads=threads)


def decode_tok_s(engine, seed: int, args) -> float:
    prompt = make_prompts(1, args.prompt_len, seed=seed)
    return args.output_len / run_meshserve(engine, prompt, args.output_len)[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="a YAML config (default: the built-in one)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=5, help="requests measured without a compile, and compiled")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--serve-seconds", type=float, default=120,
                   help="serve requests during the compile for at most this long (then it finishes idle)")
    p.add_argument("--max-seconds", type=float, default=1800, help="give up waiting for the compile after this")
    p.add_argument("--no-throttle", action="store_true", help="the compile as before it gave way to steps")

    p.add_argument("--output", default="results/bench_background_compile.json")
    args = p.parse_args()
    if args.no_throttle:
        compile_throttle.IDLE_AFTER = 0.0  # never serving: never pauses
        compile_throttle.LOWEST_PRIORITY = 0
    seed = 0
    config, engine = build(args.config, args.overrides, False, args.threads)
    alone = []
    for _ in range(args.requests):
        seed += 1
        alone.append(decode_tok_s(engine, seed, args))
    del engine
    _, engine = build(args.config, args.overrides, True, args.threads)
    decode = engine.executor.runner.decode
    started = time.perf_counter()
    during = []
    while decode.compile_thread.is_alive() and time.perf_counter() - started < args.serve_seconds:
        seed += 1
        during.append(decode_tok_s(engine, seed, args))
        print(f"# during the compile: {during[-1]:.1f} tok/s", flush=True)
    served_seconds = time.perf_counter() - started
    decode.compile_thread.join(timeout=args.max_seconds)  # the rest idle, at full speed
    compile_seconds = time.perf_counter() - started
    compiled = []
    if decode.compiled is not None:
        for _ in range(args.requests):
            seed += 1
            compiled.append(decode_tok_s(engine, seed, args))
    row = {"cpu": cpu_features().describe(), "dtype": config.torch_dtype_name,
           "quantization": str(config.model.quantization), "overrides": args.overrides,
           "throttle": not args.no_throttle, "threads": args.threads, "eager_tok_s": statistics.median(alone),
           "during_compile_tok_s": statistics.median(during) if during else None, "during_requests": len(during),
           "served_seconds": served_seconds, "compile_seconds": compile_seconds,
           "compiled_tok_s": statistics.median(compiled) if compiled else None}
    row["kept_share"] = row["during_compile_tok_s"] / row["eager_tok_s"] if during else None
    print(f"{row['cpu']}; {row['dtype']}, quantization {row['quantization']}, {args.threads} threads, "
          f"throttle {'on' if row['throttle'] else 'off'}")
    print(f"eager, no compile:      {row['eager_tok_s']:.1f} tok/s (median of {len(alone)})")
    if during:
        print(f"eager during compile:   {row['during_compile_tok_s']:.1f} tok/s (median of {len(during)}), "
              f"{100 * row['kept_share']:.0f}% of eager")
    print(f"compile:                {compile_seconds:.0f} s, serving for the first {served_seconds:.0f} s"
          + ("" if decode.compiled else " (not done)"))
    if compiled:
        print(f"compiled:               {row['compiled_tok_s']:.1f} tok/s (median of {len(compiled)})")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
