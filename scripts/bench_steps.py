"""Where serving time goes at a fixed concurrency, in-process: --concurrency requests kept
in flight (a finished one is replaced at once, as `meshserve bench --max-concurrency` does),
each a --prompt-len prompt and --output-len tokens; every engine step is timed and counted
as decode-only (all sequences decode one token; what device.compile runs compiled) or as
carrying prefill chunks. Prints output tok/s, each kind's steps, seconds and ms per step,
and the decode step time that a target tok/s would need; writes JSON.

    python scripts/bench_steps.py [--concurrency 32] [--set model.dtype=bfloat16] [--set device.compile=true]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


from bench_offline import make_prompts
from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine.build import build_single_rank_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128, help="requests finished before it stops")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--target", type=float, default=1000.0, help="output tok/s to size the decode step for")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--output", default="results/bench_steps.json")
    args = ap.parse_args()
    config = load_config(None, ["model.max_model_len=1024", "device.compile_wait=true", *args.set])
    info = check_config(config)
    engine = build_single_rank_engine(config, info, plan_memory(config, info), threads=args.threads)
    prompts = make_prompts(args.requests + args.concurrency, args.prompt_len, seed=3)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    submitted = finished = tokens = 0
    kinds = {"decode-only": [0, 0.0], "with prefill": [0, 0.0]}

    def submit() -> None:
        nonlocal submitted
        engine.add_request(submitted, str(submitted), prompts[submitted], params)
        submitted += 1

    for _ in range(args.concurrency):
        submit()
    start = time.perf_counter()
    while finished < args.requests:
        decode_only = not engine.scheduler.waiting and all(seq.num_uncomputed <= 1 for seq in engine.scheduler.running)
        step_start = time.perf_counter()
        out = engine.step()
        kind = kinds["decode-only" if decode_only else "with prefill"]
        kind[0] += 1
        kind[1] += time.perf_counter() - step_start
        for _, delta in out:
            tokens += len(delta.token_ids)
            if delta.finish_reason:
                finished += 1
                submit()
    elapsed = time.perf_counter() - start
    rate = tokens / elapsed
    prefill_seconds = kinds["with prefill"][1]
    needed = (tokens / args.target - prefill_seconds) / max(kinds["decode-only"][0], 1)
    print(f"{args.concurrency} in flight, {args.prompt_len}-token prompts, {args.output_len} output tokens, config "
          f"{' '.join(args.set) or 'default'}: {rate:.1f} output tok/s")
    for name, (steps, seconds) in kinds.items():
        print(f"  {name:<13} {steps:5d} steps  {seconds:7.1f} s  {1000 * seconds / max(steps, 1):7.1f} ms/step")
    print(f"  {args.target:.0f} tok/s with these prefill steps would need decode steps of {1000 * needed:.1f} ms")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args.set, "tok_s": rate, "steps": kinds, "needed_decode_ms": 1000 * needed,
                               "target": args.target}, indent=1))


if __name__ == "__main__":
    main()
