"""What this round's features cost when a workload does not use them: `meshserve bench` at
concurrency 32 (128-token random prompts, 128 output tokens, no shared prefixes, no
constrained request) against servers that differ in one switch each, all up at once, in
rounds whose order rotates:

- baseline: cache.prefix_caching=false, no speculation;
- prefix caching on (the default): every block hashed and kept, no hit;
- speculation adaptive: speculative.method=ngram on output the prompt does not predict
  (sampled at temperature 1.0 in every arm), where the adaptive draft length must keep
  proposals from costing anything.

Prints each arm's median output tokens/s and TPOT p99 and its ratio to the baseline; writes
JSON under results/bench_feature_cost/.

    python scripts/bench_feature_cost.py [--rounds 3] [--concurrency 32] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench_http import bench, medians, meshserve_server, rotating_rounds

from meshserve.configs.cpu_features import cpu_features

REPO = Path(__file__).resolve().parent.parent
ARMS = {
    "baseline (no prefix caching)": ["cache.prefix_caching=false"],
    "prefix caching on": [],
    "speculation adaptive (ngram)": ["speculative.method=ngram"],
}
KEYS = ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-slot", type=int, default=1)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every arm (repeatable)")
    p.add_argument("--out", default=str(REPO / "results" / "bench_feature_cost"))
    args = p.parse_args()

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(ARMS)
    servers, urls = {}, {}
    sampled = ["--temperature", "1.0"]

    def run(name: str, r: int) -> dict:
        res = bench(urls[name], args.concurrency, args, out_dir / f"arm{names.index(name)}_r{r}.json", sampled,
                    seed=r)  # every arm the same prompts in a round, none seen before
        return {k: res[k] for k in KEYS}

    try:
        for i, name in enumerate(names):
            overrides = ["cache.memory=512MiB", "model.max_model_len=1024", *args.overrides, *ARMS[name]]
            servers[name] = meshserve_server(name, overrides, out_dir / f"server{i}.log")
        for i, name in enumerate(names):
            urls[name] = servers[name].wait_http(None)
            bench(urls[name], args.concurrency, args, out_dir / f"warmup{i}.json", sampled, seed=1000)
        runs = rotating_rounds(names, args.rounds, run)
    finally:
        for s in servers.values():
            s.stop()

    by_arm = medians(runs, KEYS)
    base = by_arm[names[0]]["output_throughput"]
    print(f"\nSmolLM2-135M-Instruct, concurrency {args.concurrency}, {args.input_len}/{args.output_len} tokens, "
          f"temperature 1.0, medians of {args.rounds} rounds; CPU: {cpu_features().describe()}, "
          f"{os.cpu_count()} cores")
    print(f"{'arm':<32}{'out tok/s':>10}{'vs base':>9}{'TPOT p99':>10}  rounds (tok/s)")
    for n in names:
        m = by_arm[n]
        each = ", ".join(f"{run['output_throughput']:.1f}" for run in runs[n])
        print(f"{n:<32}{m['output_throughput']:>10.1f}{m['output_throughput'] / base:>8.3f}x"
              f"{m['p99_tpot_ms']:>10.1f}  {each}")
    summary = {"cpu": cpu_features().describe(), "cores": os.cpu_count(), "concurrency": args.concurrency,
               "rounds": runs, "medians": by_arm,
               "ratio_to_baseline": {n: by_arm[n]["output_throughput"] / base for n in names}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out_dir}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
