"""What sampling costs a serving batch: one meshserve server, `meshserve bench` at one
concurrency (default 32) greedy, at temperature 1.0, and at temperature 0.7 + top_p 0.9,
in rounds whose order rotates (drift on a shared machine falls on every setting). Prints
each setting's median output tokens/s, TPOT and its ratio to greedy; writes every bench
JSON and a summary under results/bench_sampling/.

    python scripts/bench_sampling.py [--rounds 3] [--concurrency 32] [--set KEY=VALUE ...]
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
SETTINGS = {
    "greedy": ["--temperature", "0"],
    "temperature 1.0": ["--temperature", "1.0"],
    "temperature 0.7 + top_p 0.9": ["--temperature", "0.7", "--top-p", "0.9"],
}
KEYS = ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-slot", type=int, default=2, help="prompts per concurrency slot in each run")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="meshserve config override (repeatable)")
    p.add_argument("--out", default=str(REPO / "results" / "bench_sampling"))
    args = p.parse_args()

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(SETTINGS)
    served = meshserve_server("meshserve", args.overrides, out_dir / "meshserve.log")

    def run(name: str, r: int) -> dict:
        tag = name.split(" ")[0] + ("_top_p" if "top_p" in name else "")
        # a seed per run: prompts the prefix cache has not seen
        res = bench(url, args.concurrency, args, out_dir / f"{tag}_r{r}.json", SETTINGS[name],
                    seed=r * len(names) + names.index(name))
        return {k: res[k] for k in KEYS}

    try:
        url = served.wait_http(None)
        bench(url, args.concurrency, args, out_dir / "warmup.json", SETTINGS["temperature 1.0"], seed=1000)
        runs = rotating_rounds(names, args.rounds, run)
    finally:
        served.stop()

    by_setting = medians(runs, KEYS)
    base = by_setting["greedy"]["output_throughput"]
    print(f"\nSmolLM2-135M-Instruct, concurrency {args.concurrency}, {args.input_len}/{args.output_len} tokens, "
          f"medians of {args.rounds} rounds; config {' '.join(args.overrides) or 'default'}; "
          f"CPU: {cpu_features().describe()}, {os.cpu_count()} cores")
    print(f"{'setting':<30}{'out tok/s':>10}{'vs greedy':>10}{'TPOT p50':>10}{'TPOT p99':>10}  rounds (tok/s)")
    for n in names:
        m = by_setting[n]
        each = ", ".join(f"{run['output_throughput']:.1f}" for run in runs[n])
        print(f"{n:<30}{m['output_throughput']:>10.1f}{m['output_throughput'] / base:>9.3f}x"
              f"{m['median_tpot_ms']:>10.1f}{m['p99_tpot_ms']:>10.1f}  {each}")
    summary = {"cpu": cpu_features().describe(), "cores": os.cpu_count(), "concurrency": args.concurrency,
               "input_len": args.input_len, "output_len": args.output_len, "overrides": args.overrides,
               "rounds": runs, "medians": by_setting,
               "ratio_to_greedy": {n: by_setting[n]["output_throughput"] / base for n in names}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out_dir}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
