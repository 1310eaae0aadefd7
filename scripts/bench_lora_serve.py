"""Serving LoRA adapters: SmolLM2-135M-Instruct with --adapters adapters of rank --rank (random
PEFT-format weights on all seven projections; speed does not depend on their values), each
request naming one at random, against the same server without adapters; meshserve and vLLM's
CPU build (`--enable-lora`) side by side on the same Hugging Face directory and the same
adapter directories, each measured by both benchmark clients (`meshserve bench --lora-modules`
and `vllm bench serve --lora-modules`), random --input-len prompts and exactly --output-len
output tokens at concurrency --concurrency, greedy unless --temperature says otherwise.

Servers, one up at a time, started in turn each round (the order rotating): `meshserve`,
`meshserve-lora`, `vllm`, `vllm-lora` (vLLM tuned as scripts/bench_vs_vllm.py runs it: both
cores computing, tcmalloc and Intel's OpenMP preloaded where found; --no-vllm leaves it out).
Each server's first full batch is an unmeasured warm-up; every run sends prompts new to the
server. Prints the medians over --rounds of output tok/s and TTFT/TPOT p50, each engine's
adapters-over-none ratio, and meshserve-lora over vllm-lora per client; writes JSON.

    python scripts/bench_lora_serve.py [--adapters 8] [--rank 16] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_http import Served
from bench_lora import write_adapters
from bench_vs_vllm import REPO, hf_checkpoint, vllm_preload
from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.model_info import read_model_info
from meshserve.launcher.network import free_port

HERE = Path(__file__).resolve().parent
NAME = "smollm2"


def servers(args, model: Path, adapters: dict[str, str], out: Path) -> dict[str, tuple]:
    """name -> (command, environment, URL or None for meshserve's ready line, log, adapters served)."""
    cores = len(os.sched_getaffinity(0))
    lora = ["--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank)]
    modules = [f"{n}={p}" for n, p in adapters.items()]
    found: dict[str, tuple] = {}
    for name, extra in (("meshserve", []), ("meshserve-lora", ["--lora-modules", *modules, *lora])):
        cmd = [sys.executable, "-m", "meshserve.launcher.cli", "serve", "--set", f"model.path={model}",
               "--set", f"model.dtype={args.dtype}", "--set", "server.http=127.0.0.1:0",
               "--set", f"server.model_name={NAME}", "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}", *extra]
        found[name] = (cmd, None, None, out / f"{name}.log", list(adapters) if extra else [])
    if args.vllm:
        preload = ":".join(str(lib) for lib in vllm_preload(args.vllm_python))
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
                            **({"LD_PRELOAD": preload} if preload else {})}
        for name, extra in (("vllm", []), ("vllm-lora", ["--enable-lora", "--lora-modules", *modules, *lora])):
            port = free_port()
            cmd = [args.vllm_python, str(HERE / "peers" / "vllm_cli.py"), "serve", str(model), "--dtype", args.dtype,
                   "--host", "127.0.0.1", "--port", str(port), "--served-model-name", NAME, *extra]
            found[name] = (cmd, env, f"http://127.0.0.1:{port}", out / f"{name}.log", list(adapters) if extra else [])
    return found


def meshserve_client(url: str, args, seed: int, adapters: list[str], out: Path, output_len: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "meshserve.launcher.cli", "bench", "--url", url, "--model", NAME,
           "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
           "--input-len", str(args.input_len), "--output-len", str(output_len or args.output_len),
           "--temperature", str(args.temperature), "--seed", str(seed), "--output", str(out), "--disable-tqdm",
           "--no-plots", *(["--lora-modules", *adapters] if adapters else [])]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def vllm_client(url: str, args, seed: int, adapters: list[str], out: Path, model: Path) -> dict:
    env = os.environ | {"VLLM_BENCH_DROP_DEFAULT_REP_PENALTY": "1"}
    cmd = [args.vllm_python, str(HERE / "peers" / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--ignore-eos", "--num-prompts", str(args.prompts), "--max-concurrency",
           str(args.concurrency), "--temperature", str(args.temperature), "--seed", str(seed), "--save-result",
           "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           *(["--lora-modules", *adapters] if adapters else [])]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    return json.loads(out.read_text())


FIELDS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default=None, help="both engines' (default: bfloat16 where the CPU computes it, "
                                                 "else float32)")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--vllm-python", default=str(Path.home() / "venv-vllm" / "bin" / "python"))
    p.add_argument("--out", default=str(REPO / "results" / "bench_lora_serve"))
    args = p.parse_args()
    cpu = cpu_features()
    args.dtype = args.dtype or ("bfloat16" if cpu.bf16_compute else "float32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = hf_checkpoint(REPO / "results" / "smollm2-hf-bf16")
    adapter_dir = out / "adapters"
    if not (adapter_dir / f"bench{args.adapters - 1}" / "adapter_config.json").is_file():
        adapter_dir.mkdir(exist_ok=True)
        for old in adapter_dir.iterdir():
            subprocess.run(["rm", "-rf", str(old)], check=True)
        write_adapters(read_model_info(str(model)), adapter_dir, args.adapters, args.rank, model)
    adapters = {f"bench{i}": str(adapter_dir / f"bench{i}") for i in range(args.adapters)}
    found = servers(args, model, adapters, out)
    clients = {"meshserve bench": lambda url, seed, names, o: meshserve_client(url, args, seed, names, o),
               "vllm bench serve": lambda url, seed, names, o: vllm_client(url, args, seed, names, o, model)}
    if not args.vllm:
        del clients["vllm bench serve"]
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        names = list(found)
        for name in names[r % len(names):] + names[:r % len(names)]:
            cmd, env, url, log, served = found[name]
            print(f"# round {r + 1}: starting {name}", file=sys.stderr, flush=True)
            server = Served(name, cmd, log.with_name(f"{log.stem}_r{r}.log"), env=env)
            try:
                base = server.wait_http(url, timeout=1800)
                meshserve_client(base, args, 10_000 + 100 * r + 99, served, out / f"{name}_warmup_r{r}.json",
                                 output_len=32)
                for k, (client, fn) in enumerate(clients.items()):
                    print(f"# round {r + 1}: {name} {client}", file=sys.stderr, flush=True)
                    result = fn(base, 100 * r + k, served, out / f"{name}_{client.split()[0]}_r{r}.json")
                    runs.setdefault(f"{name}|{client}", []).append({f: result[f] for f in FIELDS} |
                                                                   {"completed": result["completed"]})
            finally:
                server.stop()

    def med(key: str, field: str) -> float:
        return statistics.median(x[field] for x in runs[key])

    print(f"\nSmolLM2-135M-Instruct, {args.dtype}, {args.adapters} adapters of rank {args.rank} (random per request) "
          f"vs none, c={args.concurrency}, {args.input_len}/{args.output_len}, temperature {args.temperature:g}, "
          f"{cpu.describe()}; medians of {args.rounds} rounds")
    print(f"{'client':<18}{'server':>16}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}{'x none':>8}")
    summary: dict = {"args": vars(args), "cpu": cpu.describe(), "rows": [], "runs": runs}
    for client in clients:
        for name in found:
            key = f"{name}|{client}"
            plain = name.removesuffix("-lora")
            ratio = statistics.median(a["output_throughput"] / b["output_throughput"]
                                      for a, b in zip(runs[key], runs[f"{plain}|{client}"]))
            row = {"client": client, "server": name, **{f: med(key, f) for f in FIELDS}, "vs_no_adapters": ratio,
                   "failed": sum(args.prompts - x["completed"] for x in runs[key])}
            summary["rows"].append(row)
            print(f"{client:<18}{name:>16}{row['output_throughput']:>11.1f}{row['median_ttft_ms']:>10.0f}"
                  f"{row['median_tpot_ms']:>10.1f}{ratio:>7.2f}x")
        if args.vllm:
            vs = statistics.median(a["output_throughput"] / b["output_throughput"]
                                   for a, b in zip(runs[f"meshserve-lora|{client}"], runs[f"vllm-lora|{client}"]))
            summary.setdefault("meshserve_lora_vs_vllm_lora", {})[client] = vs
            print(f"{client:<18}{'meshserve-lora / vllm-lora':>45}{vs:>7.2f}x")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
