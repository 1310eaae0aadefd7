"""Serving over HTTP: meshserve vs llama-cpp-python's server on the same GGUF, measured by the
same `meshserve bench`, side by side in one run.

Both servers stay up for the whole run; the sweeps interleave (concurrency 1: meshserve then
the peer, then 8, then 32), so drift on a shared machine hits both alike. Each run sends
random-text prompts of --input-len tokens and asks for exactly --output-len tokens
(ignore_eos / min_tokens). Prints output tokens/s, goodput at the SLOs, TTFT and TPOT
p50/p99, and the meshserve/peer ratios; writes every `meshserve bench` JSON and a summary
under results/bench_http/.

    pip install 'llama-cpp-python[server]'     # the peer (builds llama.cpp: 10-17 min on 2 cores)
    python scripts/bench_http.py [--concurrency 1 8 32] [--set model.dtype=bfloat16] [--no-peer]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from meshserve.configs.model_info import resolve_model_path
from meshserve.launcher.network import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SLO = {"ttft": 2000.0, "tpot": 100.0}


class Served:
    """A server process, its log, and its base URL once it answers."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None):
        self.name, self.log = name, log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
                                     start_new_session=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._log.write(line)

    def wait_http(self, url: str | None, timeout: float = 600) -> str:
        """Wait until `url` (or the URL of meshserve's ready line) answers /v1/models."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            if url is None:
                m = next((re.search(r"http=(http://\S+)", line) for line in self.lines if "ready" in line), None)
                url = m.group(1) if m else None
            if url is not None:
                try:
                    if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not come up within {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def meshserve_server(name: str, overrides: list[str], log: Path, env: dict[str, str] | None = None) -> Served:
    """`meshserve serve` on free ports, with these config overrides."""
    return Served(name, [sys.executable, "-m", "meshserve.launcher.cli", "serve", "--set", "server.http=127.0.0.1:0",
                         "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}",
                         *[a for o in overrides for a in ("--set", o)]], log, env=env)


def rotating_rounds(names: list[str], rounds: int, run) -> dict[str, list[dict]]:
    """`run(name, round)` for every name in each round, the order rotating from round to
    round (drift on a shared machine falls on every arm alike): name -> its runs."""
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            print(f"# round {r}: {name} ...", file=sys.stderr, flush=True)
            runs[name].append(run(name, r))
    return runs


def medians(runs: dict[str, list[dict]], keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    return {n: {k: statistics.median(run[k] for run in each) for k in keys} for n, each in runs.items()}


def bench(url: str, concurrency: int, args, out: Path, extra: list[str] = (), seed: int = 0,
          timeout: float | None = None) -> dict:
    """One `meshserve bench` run; `extra`: more of its flags (e.g. --temperature 1.0). Give each
    run on one server its own `seed`: the same seed sends the same prompts, which the server's
    prefix cache then serves from the run before. `timeout`: seconds before the run is killed."""
    num_prompts = max(args.min_prompts, args.prompts_per_slot * concurrency)
    cmd = [sys.executable, "-m", "meshserve.launcher.cli", "bench", "--url", url, "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--slo", f"ttft={SLO['ttft']:g},tpot={SLO['tpot']:g}",
           "--seed", str(seed), "--output", str(out), "--disable-tqdm", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=timeout)
    return json.loads(out.read_text())


def row(name: str, c: int, r: dict) -> str:
    return (f"{name:<18}{c:>4}{r['completed']:>6}/{r['num_prompts']:<4}{r['output_throughput']:>10.1f}"
            f"{r['request_goodput']:>10.3f}{r['median_ttft_ms']:>10.0f}{r['p99_ttft_ms']:>10.0f}"
            f"{r['median_tpot_ms']:>9.1f}{r['p99_tpot_ms']:>9.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-slot", type=int, default=2, help="prompts per concurrency slot in each run")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="meshserve config override (repeatable), e.g. model.dtype=bfloat16")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the meshserve server (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE")
    p.add_argument("--threads", type=int, default=2, help="the peer's --n_threads")
    p.add_argument("--no-peer", action="store_true", help="meshserve only")
    p.add_argument("--out", default=str(REPO / "results" / "bench_http"))
    args = p.parse_args()

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf = resolve_model_path("builtin:smollm2-135m-instruct")
    servers: dict[str, Served] = {}
    urls: dict[str, str] = {}
    try:
        servers["meshserve"] = meshserve_server("meshserve", args.overrides, out_dir / "meshserve.log",
                                                env=os.environ | dict(e.split("=", 1) for e in args.env))
        if not args.no_peer:
            port = free_port()
            # NOTE: use_extra_bufts=False (set by the wrapper): the stock build dies with SIGILL in
            # its AMX repacking path on this CPU. interrupt_requests=False: requests run to the end.
            servers["llama-cpp-python"] = Served("llama-cpp-python", [
                sys.executable, str(HERE / "peers" / "llama_cpp_server.py"), "--model", str(gguf),
                "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", str(port)],
                out_dir / "llama_cpp_server.log")
            urls["llama-cpp-python"] = servers["llama-cpp-python"].wait_http(f"http://127.0.0.1:{port}")
        urls["meshserve"] = servers["meshserve"].wait_http(None)
        results: dict[str, dict[int, dict]] = {name: {} for name in urls}
        for c in args.concurrency:
            for name, url in urls.items():
                print(f"# {name}: concurrency {c} ...", file=sys.stderr, flush=True)
                results[name][c] = bench(url, c, args, out_dir / f"{name}_c{c}.json", seed=c)
    finally:
        for s in servers.values():
            s.stop()

    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1), {args.input_len}-token prompts, {args.output_len} output tokens; "
          f"goodput: TTFT <= {SLO['ttft']:g} ms and TPOT <= {SLO['tpot']:g} ms; meshserve config: "
          f"{' '.join(args.overrides) or 'default'}{'; env ' + ' '.join(args.env) if args.env else ''}")
    print(f"{'server':<18}{'conc':>4}{'done':>11}{'out tok/s':>10}{'goodput':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'TPOT p50':>9}{'TPOT p99':>9}")
    for c in args.concurrency:
        for name in urls:
            print(row(name, c, results[name][c]))
    summary = {"input_len": args.input_len, "output_len": args.output_len, "slo_ms": SLO, "overrides": args.overrides,
               "env": args.env,
               "runs": {name: {str(c): {k: r[k] for k in ("completed", "failed", "num_prompts", "output_throughput",
                                                          "request_throughput", "request_goodput", "median_ttft_ms",
                                                          "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                                                          "median_itl_ms", "p99_itl_ms", "duration")}
                                    for c, r in runs.items()} for name, runs in results.items()}}
    if "llama-cpp-python" in results:
        print("\nmeshserve / llama-cpp-python:")
        ratios = {}
        for c in args.concurrency:
            m, l = results["meshserve"][c], results["llama-cpp-python"][c]
            tput = m["output_throughput"] / l["output_throughput"]
            good = (m["request_goodput"] / l["request_goodput"]) if l["request_goodput"] else float("inf")
            ratios[str(c)] = {"output_throughput": tput, "request_goodput": good}
            goodput = f"x{good:.2f}" if l["request_goodput"] else f"{m['request_goodput']:.3f} req/s vs 0"
            print(f"  concurrency {c:>3}: output tok/s x{tput:.2f}, goodput {goodput}")
        summary["ratios"] = ratios
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out_dir}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
