"""The CPU speed switches on this machine: for each config, `meshserve serve` to `ready`
(the first start with an empty meshserve cache, as on a fresh install, and later starts),
then `meshserve bench` output tokens/s, TTFT and TPOT at each concurrency. A config that
compiles in the background (device.compile) is benched once its graphs are ready, and the
time from start to that is printed too.

Each round starts every config's server afresh, in an order that rotates from round to
round (drift on a shared machine spreads over all configs); the first round's servers see
an empty cache (a temporary HOME: the C++ kernels build, the GGUF tokenizer converts),
later rounds the machine's own (filled once). A config the machine refuses (e.g. w8a8 without
VNNI) is reported with the server's message. Prints medians over the rounds and writes
every `meshserve bench` JSON and a summary under results/bench_switches/.

    python scripts/bench_switches.py [--rounds 3] [--concurrency 1 8 32]
        [--config NAME=OVERRIDE,OVERRIDE ...]   (default: the switches below)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_http import Served, bench, free_port

from meshserve.configs.cpu_features import cpu_features

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIGS = REPO / "configs"

SWITCHES = {
    "default": [],
    "float32": ["model.dtype=float32"],
    "bfloat16": ["model.dtype=bfloat16"],
    "int8 (bf16)": ["model.quantization=int8"],
    "int4 (smollm2-cpu-int4.yaml)": [f"@{CONFIGS / 'smollm2-cpu-int4.yaml'}"],
    "float32+int4": ["model.dtype=float32", "model.quantization=int4"],
    "w8a8 (smollm2-cpu-w8a8.yaml)": [f"@{CONFIGS / 'smollm2-cpu-w8a8.yaml'}"],
}
"""name -> overrides; `@FILE` names the config file the overrides apply to. `default` is
`meshserve serve` with no flags, whatever model.dtype auto resolves to on this machine."""

KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def serve_command(overrides: list[str]) -> list[str]:
    files = [o[1:] for o in overrides if o.startswith("@")]
    cmd = [sys.executable, "-m", "meshserve.launcher.cli", "serve", *files, "--set", "server.http=127.0.0.1:0",
           "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}"]
    for o in overrides:
        if not o.startswith("@"):
            cmd += ["--set", o]
    return cmd


def run_config(name: str, overrides: list[str], args, out_dir: Path, round_no: int, home: str | None) -> dict:
    """One fresh server: its ready time and a bench per concurrency (or why it refused)."""
    env = os.environ | ({"HOME": home} if home else {})
    tag = name.split(" ")[0].replace("+", "_")
    start = time.perf_counter()
    served = Served(name, serve_command(overrides), out_dir / f"{tag}_r{round_no}.log", env=env)
    try:
        try:
            url = served.wait_http(None, timeout=args.start_timeout)
        except RuntimeError as e:
            reason = served.log.read_text().strip().splitlines()
            return {"refused": reason[-1] if reason else str(e)}
        result = {"ready_s": time.perf_counter() - start, "runs": {}}
        if "compiling the decode step" in served.log.read_text():  # device.compile: in the background
            while "compiled the decode step in" not in served.log.read_text():
                if served.proc.poll() is not None:
                    raise RuntimeError(f"{name} exited while compiling; see {served.log}")
                time.sleep(0.5)
            result["compiled_s"] = time.perf_counter() - start  # the benches below run compiled
        for c in args.concurrency:
            print(f"# round {round_no} {name}: concurrency {c} ...", file=sys.stderr, flush=True)
            r = bench(url, c, args, out_dir / f"{tag}_r{round_no}_c{c}.json", seed=c)  # no prompt of the run before
            result["runs"][str(c)] = {k: r[k] for k in (*KEYS, "completed", "num_prompts")}
        return result
    finally:
        served.stop()


def median_of(rounds: list[dict], c: str, key: str) -> float | None:
    values = [r["runs"][c][key] for r in rounds if "runs" in r]
    return statistics.median(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32],
                   help="concurrencies to bench each server at (none: only the start times)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-slot", type=int, default=1, help="prompts per concurrency slot in each run")
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--fresh-home", action=argparse.BooleanOptionalAction, default=True,
                   help="the first round's servers on an empty meshserve cache (--no-fresh-home: the machine's)")
    p.add_argument("--config", action="append", default=[], metavar="NAME=OVERRIDE,OVERRIDE",
                   help="a config to measure instead of the default switches (repeatable; @FILE for a config file)")
    p.add_argument("--out", default=str(REPO / "results" / "bench_switches"))
    args = p.parse_args()

    configs = {c.split("=", 1)[0]: [o for o in c.split("=", 1)[1].split(",") if o] for c in args.config} or SWITCHES
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(configs)
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="meshserve-fresh-home-") as fresh_home:
        for round_no in range(args.rounds):
            order = names[round_no % len(names):] + names[:round_no % len(names)]
            for name in order:
                # each config's first server starts on an empty meshserve cache (a fresh install)
                home = str(Path(fresh_home) / str(names.index(name))) if round_no == 0 and args.fresh_home else None
                results[name].append(run_config(name, configs[name], args, out_dir, round_no, home))

    print(f"\nSmolLM2-135M-Instruct, {args.input_len}-token prompts, {args.output_len} output tokens, "
          f"medians of {args.rounds} rounds; CPU: {cpu_features().describe()}, {os.cpu_count()} cores")
    header = f"{'config':<30}{'first start':>12}{'later start':>12}"
    for c in args.concurrency:
        header += f"{f'c={c} tok/s':>12}{'TTFT p50/p99':>15}{'TPOT p99':>9}"
    print(header)
    summary = {"cpu": cpu_features().describe(), "cores": os.cpu_count(), "rounds": args.rounds,
               "input_len": args.input_len, "output_len": args.output_len, "configs": {}}
    for name in names:
        rounds = results[name]
        summary["configs"][name] = {"overrides": configs[name], "rounds": rounds}
        if "refused" in rounds[0]:
            print(f"{name:<30}  refused: {rounds[0]['refused']}")
            continue
        later = [r["ready_s"] for r in rounds[1:] if "ready_s" in r]
        line = f"{name:<30}{rounds[0]['ready_s']:>11.1f}s"
        line += f"{statistics.median(later):>11.1f}s" if later else f"{'-':>12}"
        medians = {}
        for c in map(str, args.concurrency):
            medians[c] = {k: median_of(rounds, c, k) for k in KEYS}
            ttft = f"{medians[c]['median_ttft_ms']:.0f}/{medians[c]['p99_ttft_ms']:.0f}"
            line += f"{medians[c]['output_throughput']:>12.1f}{ttft:>15}{medians[c]['p99_tpot_ms']:>9.1f}"
        summary["configs"][name]["medians"] = medians
        summary["configs"][name]["first_start_s"] = rounds[0]["ready_s"]
        summary["configs"][name]["later_start_s"] = statistics.median(later) if later else None
        compiled = [r["compiled_s"] for r in rounds if "compiled_s" in r]
        if compiled:
            summary["configs"][name]["compiled_s"] = compiled
            line += f"  (compiled at {', '.join(f'{t:.0f}' for t in compiled)} s)"
        print(line)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out_dir}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
