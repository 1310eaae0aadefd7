"""Ranks and cores: one stream at tp=3 on this machine with OMP_NUM_THREADS=2 in the
server's environment (a common setting: unchecked, each of the 3 ranks would run 2
threads) against the same server without the variable, and tp=1 beside them. All servers
stay up; each round runs `meshserve bench` at concurrency 1 against each in turn, in an
order that rotates. Prints median output tokens/s and TPOT, the ratio of the two tp=3
arms, and each server's thread-cap warning; writes JSON under results/bench_threads/.

    python scripts/bench_threads.py [--rounds 3] [--prompts 2]
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
    "tp=3, OMP_NUM_THREADS=2": (["parallel.tensor=3"], {"OMP_NUM_THREADS": "2"}),
    "tp=3": (["parallel.tensor=3"], {}),
    "tp=1": ([], {}),
}
KEYS = ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=2, help="prompts per run, one at a time")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", default=str(REPO / "results" / "bench_threads"))
    args = p.parse_args()
    args.min_prompts, args.prompts_per_slot = args.prompts, args.prompts

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(ARMS)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    servers, urls = {}, {}

    def run(name: str, r: int) -> dict:
        res = bench(urls[name], 1, args, out_dir / f"arm{names.index(name)}_r{r}.json", seed=r)
        return {k: res[k] for k in KEYS}

    try:
        for i, name in enumerate(names):
            overrides, extra_env = ARMS[name]
            servers[name] = meshserve_server(name, ["cache.memory=256MiB", "model.max_model_len=1024", *overrides],
                                             out_dir / f"server{i}.log", env=env | extra_env)
        for name in names:
            urls[name] = servers[name].wait_http(None)
            bench(urls[name], 1, args, out_dir / f"warmup{names.index(name)}.json", seed=1000)
        runs = rotating_rounds(names, args.rounds, run)
    finally:
        for s in servers.values():
            s.stop()

    warnings = {n: [line.strip() for line in s.log.read_text().splitlines() if "capped at" in line][:1]
                for n, s in servers.items()}
    by_arm = medians(runs, KEYS)
    print(f"\nSmolLM2-135M-Instruct, one stream, {args.input_len}/{args.output_len} tokens, medians of {args.rounds} "
          f"rounds; CPU: {cpu_features().describe()}, {os.cpu_count()} cores")
    print(f"{'server':<26}{'out tok/s':>10}{'TPOT p50':>10}{'TPOT p99':>10}  rounds (tok/s)")
    for n in names:
        m = by_arm[n]
        each = ", ".join(f"{run['output_throughput']:.2f}" for run in runs[n])
        print(f"{n:<26}{m['output_throughput']:>10.2f}{m['median_tpot_ms']:>10.1f}{m['p99_tpot_ms']:>10.1f}  {each}")
    ratio = by_arm[names[0]]["output_throughput"] / by_arm[names[1]]["output_throughput"]
    print(f"\ntp=3 with OMP_NUM_THREADS=2 / without: {ratio:.3f}x")
    for n, w in warnings.items():
        print(f"{n}: {w[0] if w else 'no thread-cap warning'}")
    summary = {"cpu": cpu_features().describe(), "cores": os.cpu_count(), "rounds": runs, "medians": by_arm,
               "ratio_with_variable": ratio, "warnings": warnings}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out_dir}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
