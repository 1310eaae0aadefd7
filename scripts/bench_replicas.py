"""Data-parallel replicas (parallel.data) measured by `meshserve bench`, in one run:

- throughput: dp=2 (a replica per core, one thread each) against dp=1 (one replica, a
  thread per core): output tokens/s at --concurrency (default 32) on random prompts of
  --input-len tokens with exactly --output-len output tokens;
- routing: two dp=2 deployments, router.policy cache_aware and least_loaded, on a
  multi-tenant shared-prefix workload: --num-prefixes system prompts of --prefix-len
  tokens, each request one of them (in random order) plus --suffix-len tokens of its own.
  Each replica's KV cache (--cache-memory, 112 MiB: 2,548 tokens of SmolLM2 in float32)
  holds a little over half of the prefixes (4.6 of 8 at 512 tokens), so the two together
  hold them all: cache-aware routing keeps each prefix on one replica, where it stays
  cached; least-loaded routing spreads every prefix over both, and each replica's cache
  keeps evicting what it will need next. Prints the prefix-cache hit rate (cached prompt
  tokens / prompt tokens, from the usage) and TTFT p50. --routing-replicas 4 --cache-memory
  64MiB: four replicas (sharing the cores) each holding 2.7 prefixes: cache-aware routing
  keeps two on each, least-loaded routing has every replica see all eight.

The two servers of a part are up together (an idle server costs the other nothing); each
round measures one and right after the other (swapping who goes first every round), after
POST /reset_prefix_cache, with the round's seed: each ratio is taken within a round, and
the medians over --rounds are printed and written to --out/summary.json.

    python scripts/bench_replicas.py [--parts throughput routing] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

from bench_http import Served
from meshserve.configs.cpu_features import cpu_features
from meshserve.launcher.network import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def server(name: str, sets: list[str], out_dir: Path) -> Served:
    return Served(name, [sys.executable, "-m", "meshserve.launcher.cli", "serve", "--set", "server.http=127.0.0.1:0",
                         "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}", *[a for s in sets for a in ("--set", s)]],
                  out_dir / f"{name}.log")


def bench(url: str, name: str, flags: list[str], seed: int, out: Path) -> dict:
    reset = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
    reset.raise_for_status()
    cmd = [sys.executable, "-m", "meshserve.launcher.cli", "bench", "--url", url, *flags, "--seed", str(seed),
           "--temperature", "0", "--output", str(out), "--no-plots", "--disable-tqdm"]
    print(f"# {name} seed {seed}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def parts(args) -> dict[str, tuple[dict[str, list[str]], list[str]]]:
    """part -> ({server name: its overrides}, the bench flags)."""
    common = ["model.max_model_len=2048", *args.overrides]
    return {
        "throughput": ({"dp1": ["parallel.data=1", *common], "dp2": ["parallel.data=2", *common]},
                       ["--dataset-name", "random", "--input-len", str(args.input_len), "--output-len",
                        str(args.output_len), "--num-prompts", str(2 * args.concurrency), "--max-concurrency",
                        str(args.concurrency), "--ignore-eos"]),
        "routing": ({policy: [f"parallel.data={args.routing_replicas}", f"router.policy={policy}",
                              f"cache.memory={args.cache_memory}",
                              *common] for policy in ("cache_aware", "least_loaded")},
                    ["--dataset-name", "prefix-repetition", "--num-prefixes", str(args.num_prefixes), "--prefix-len",
                     str(args.prefix_len), "--suffix-len", str(args.suffix_len), "--output-len", "16",
                     "--num-prompts", str(args.routing_prompts), "--max-concurrency", str(args.routing_concurrency)]),
    }


KEYS = ("output_throughput", "median_ttft_ms", "prefix_cache_hit_rate", "median_tpot_ms")


def summarize(runs: dict[str, list[dict]], first: str, second: str) -> dict:
    out: dict = {}
    for name, rs in runs.items():
        out[name] = {k: statistics.median(r[k] for r in rs) if all(r.get(k) is not None for r in rs) else None
                     for k in KEYS}
        out[name]["failed"] = sum(r["failed"] for r in rs)
    for k in KEYS:
        ratios = [a[k] / b[k] for a, b in zip(runs[first], runs[second]) if a.get(k) and b.get(k)]
        out[f"{first}/{second} {k}"] = {"median": statistics.median(ratios) if ratios else None, "rounds": ratios}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["throughput", "routing"], choices=["throughput", "routing"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--routing-prompts", type=int, default=96)
    p.add_argument("--routing-concurrency", type=int, default=8)
    p.add_argument("--cache-memory", default="112MiB", help="each replica's KV cache in the routing part")
    p.add_argument("--routing-replicas", type=int, default=2, help="parallel.data of the routing part")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override of every server (repeatable)")
    p.add_argument("--out", default=str(REPO / "results" / "bench_replicas"))
    args = p.parse_args()

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"cpu": cpu_features().describe(), "args": vars(args)}
    for part in args.parts:
        configs, flags = parts(args)[part]
        servers = {name: server(f"{part}-{name}", sets, out_dir) for name, sets in configs.items()}
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        try:
            urls = {name: s.wait_http(None) for name, s in servers.items()}
            for seed in range(args.rounds):
                order = list(urls.items())
                for name, url in order[::-1] if seed % 2 else order:
                    runs[name].append(bench(url, f"{part} {name}", flags, seed, out_dir / f"{part}_{name}_{seed}.json"))
        finally:
            for s in servers.values():
                s.stop()
        first, second = ("dp2", "dp1") if part == "throughput" else ("cache_aware", "least_loaded")
        summary[part] = summarize(runs, first, second)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nSmolLM2-135M-Instruct, {summary['cpu']}; medians of {args.rounds} rounds")
    for part in args.parts:
        s = summary[part]
        print(f"\n{part}:")
        print(f"{'server':<14}{'out tok/s':>10}{'TTFT p50':>10}{'TPOT p50':>10}{'hit rate':>10}{'failed':>8}")
        for name in parts(args)[part][0]:
            r = s[name]
            hit = f"{r['prefix_cache_hit_rate']:.3f}" if r["prefix_cache_hit_rate"] is not None else "-"
            print(f"{name:<14}{r['output_throughput']:>10.1f}{r['median_ttft_ms']:>10.0f}{r['median_tpot_ms']:>10.1f}"
                  f"{hit:>10}{r['failed']:>8}")
        for key, v in s.items():
            if "/" in key and v["median"] is not None:
                print(f"  {key}: {v['median']:.3f} (rounds {', '.join(f'{x:.3f}' for x in v['rounds'])})")
    print(f"\nwrote {out_dir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
