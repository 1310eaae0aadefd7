"""One stream on the CPU: meshserve's engine vs llama.cpp in-process (llama-cpp-python, the
same GGUF, its own Q4_1 weights and AMX kernels), in one run; with meshserve's batch-1
decode MBU and 512-token prefill MFU against the bandwidth and matmul peak measured here
(in the variant's process, right before each decode run and before the prefills).

meshserve runs in each --variants dtype[:model.quantization[:compile]] (int4 keeps the
GGUF's own Q4_1 codes, MBU then counts the quantized bytes; compile: device.compile=true,
its start-up compile time printed). Each side runs in a fresh process of its own (llama.cpp
in-process there) and prefills a 128-token prompt, then decodes --output-len tokens one at
a time (llama.cpp: `Llama.eval` of one token per step; meshserve: engine steps, EOS
ignored). Prints tok/s, the ratio to llama.cpp, MBU, MFU; median of --repeats; writes JSON.

The machine's speed drifts between processes (llama.cpp alone gave 128-188 tok/s in one
evening), so with --rounds N the peer and every variant run N times in turn: each round
runs the peer, then the variants, whose ratios are taken against that round's peer; the table shows the medians over rounds (tok/s,
ratio, MBU, prefill) and each round's ratios. Compiled variants reuse inductor's on-disk
cache after the first round, so later rounds' compile times are the cached start-up.

    pip install 'llama-cpp-python[server]'
    python scripts/bench_cpu.py [--variants float32 bfloat16 bfloat16:int4] [--repeats 3] [--rounds 3] [--no-peer]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_offline import DTYPES, make_prompts, run_meshserve
from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import DTYPE_BYTES, plan_memory
from meshserve.configs.model_info import resolve_model_path
from meshserve.configs.validate import check_config
from meshserve.engine.build import build_single_rank_engine
from meshserve.engine.perf import ModelCost, measure_matmul_peak, measure_memory_bandwidth

HERE = Path(__file__).resolve().parent


def llama_cpp_decode(gguf: str, prompt: list[int], output_len: int, threads: int) -> float:
    """Decode tok/s of llama.cpp in this process (after prefilling `prompt`): the --peer
    child's work."""
    sys.path.insert(0, str(HERE / "peers"))
    import llama_cpp_server  # noqa: F401 - sets use_extra_bufts=False (its AMX repacking dies with SIGILL here)
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for i in range(output_len):
        llm.eval([prompt[i % len(prompt)]])
    return output_len / (time.perf_counter() - start)


def prefill_seconds(engine, length: int, seed: int) -> float:
    """One prompt of `length` tokens, new to the engine's prefix cache (a seed per call)."""
    engine.add_request("prefill", "prefill", make_prompts(1, length, seed=seed)[0],
                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def parse_variant(variant: str) -> tuple[str, str, bool]:
    """dtype[:quantization[:compile]] -> (dtype, quantization, compile)."""
    dtype, quantization, *flags = variant.split(":") + ["none"]
    if dtype not in DTYPES or any(f not in ("compile", "none") for f in flags):
        raise ValueError(f"--variants {variant}: expected dtype[:quantization[:compile]], dtype one of "
                         f"{', '.join(DTYPES)}")
    return dtype, quantization, "compile" in flags


def run_variant(args, variant: str, prompt: list[int]) -> dict:
    """One meshserve variant in this process: the --variant child's work. Each decode
    repeat comes right after a read-bandwidth probe in this process, and its MBU is taken
    against that probe: the machine's bandwidth drifts by tens of percent between minutes."""
    dtype, quantization, compile_decode = parse_variant(variant)
    config = load_config(None, [f"model.dtype={dtype}", f"model.quantization={quantization}",
                                "model.max_model_len=1024", f"device.compile={compile_decode}",
                                "device.compile_wait=true"])
    info = check_config(config)
    built = time.perf_counter()
    engine = build_single_rank_engine(config, info, plan_memory(config, info), threads=args.threads)
    build_seconds = time.perf_counter() - built
    compiled = engine.executor.runner.decode.compiled
    cost = ModelCost(info, DTYPE_BYTES[dtype], quantization)
    peak = measure_matmul_peak(DTYPES[dtype], quantization=quantization)
    ctx = args.prompt_len + args.output_len // 2
    step_bytes = cost.weight_bytes + ctx * cost.kv_bytes_per_token
    bandwidths, speeds = [], []
    for _ in range(args.repeats):
        bandwidths.append(measure_memory_bandwidth())
        speeds.append(args.output_len / run_meshserve(engine, [prompt], args.output_len)[1])
    decode = statistics.median(speeds)
    prefill = statistics.median(prefill_seconds(engine, args.prefill_len, seed=1 + i) for i in range(args.repeats))
    return {"variant": variant, "dtype": dtype, "quantization": quantization, "compile": compiled is not None,
            "compile_seconds": compiled.compile_seconds if compiled else 0.0, "build_seconds": build_seconds,
            "compiled_steps": compiled.steps if compiled else 0, "decode_tok_s": decode,
            "decode_mbu": statistics.median(s * step_bytes / b for s, b in zip(speeds, bandwidths)),
            "bandwidth": statistics.median(bandwidths),
            "prefill_seconds": prefill, "prefill_mfu": cost.flops(args.prefill_len, args.prefill_len) / prefill / peak,
            "matmul_peak": peak}


def median_row(runs: list[dict]) -> dict:
    """One variant over rounds: the median of each figure, the first round's compile time,
    and each round's ratio."""
    row = dict(runs[0])
    for key in ("decode_tok_s", "decode_mbu", "bandwidth", "prefill_seconds", "prefill_mfu", "matmul_peak",
                "ratio_to_llama_cpp"):
        row[key] = statistics.median(run[key] for run in runs)
    row["ratios"] = [run["ratio_to_llama_cpp"] for run in runs]
    return row


def child(args, flag: str, value: str) -> dict:
    """Run this script for one side in a fresh process: llama.cpp's threads, torch's and
    the compiled graphs of one variant never share a process with another's."""
    cmd = [sys.executable, __file__, flag, value, "--threads", str(args.threads),
           "--repeats", str(args.repeats), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
           "--prefill-len", str(args.prefill_len)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["float32", "bfloat16", "bfloat16:int8", "bfloat16:int4",
                                                      "float32:none:compile", "bfloat16:none:compile",
                                                      "bfloat16:int4:compile"],
                    help="dtype[:model.quantization[:compile]] of each meshserve run (compile: device.compile=true)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="run the peer and every variant this many times in turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default="results/bench_cpu.json")
    ap.add_argument("--no-peer", action="store_true", help="meshserve's variants only (no llama-cpp-python)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for variant in args.variants:
        try:
            parse_variant(variant)
        except ValueError as e:
            ap.error(str(e))
    torch.set_num_threads(args.threads)
    prompt = make_prompts(1, args.prompt_len)[0]
    if args.peer:
        print(json.dumps({"tok_s": statistics.median(llama_cpp_decode(args.peer, prompt, args.output_len, args.threads)
                                                     for _ in range(args.repeats))}))
        return
    if args.variant:
        print(json.dumps(run_variant(args, args.variant, prompt)))
        return

    gguf = str(resolve_model_path("builtin:smollm2-135m-instruct"))
    peers: list[float] = []
    runs: dict[str, list[dict]] = {variant: [] for variant in args.variants}
    for r in range(args.rounds):
        peers.append(float("nan") if args.no_peer else child(args, "--peer", gguf)["tok_s"])
        print(f"round {r + 1}/{args.rounds}: llama.cpp in-process (Q4_1) {peers[-1]:.1f} tok/s", flush=True)
        for variant in args.variants:
            row = child(args, "--variant", variant)
            row["ratio_to_llama_cpp"] = row["decode_tok_s"] / peers[-1]
            runs[variant].append(row)
            print(f"  {variant:<22} {row['decode_tok_s']:6.1f} tok/s ({row['ratio_to_llama_cpp']:.2f}x), MBU "
                  f"{100 * row['decode_mbu']:.1f}% of {row['bandwidth'] / 1e9:.1f} GB/s", flush=True)
    peer = statistics.median(peers)
    bandwidths = [run["bandwidth"] for variant_runs in runs.values() for run in variant_runs]
    bandwidth = statistics.median(bandwidths)
    print(f"roofline: memory bandwidth {bandwidth / 1e9:.1f} GB/s (median of the variants' probes); "
          f"llama.cpp in-process (Q4_1): {peer:.1f} tok/s"
          + (f" (median of {args.rounds} rounds)" if args.rounds > 1 else ""), flush=True)
    rows = []
    for variant in args.variants:
        row = median_row(runs[variant])
        rows.append(row)
        print(f"meshserve {variant:<22} one stream {row['decode_tok_s']:6.1f} tok/s ({row['ratio_to_llama_cpp']:.2f}x "
              f"llama.cpp)  decode MBU {100 * row['decode_mbu']:.1f}%  {args.prefill_len}-token prefill "
              f"{1000 * row['prefill_seconds']:.0f} ms, MFU {100 * row['prefill_mfu']:.1f}% of "
              f"{row['matmul_peak'] / 1e9:.0f} GFLOP/s"
              + (f"; compiled in {row['compile_seconds']:.0f} s" if row["compile"] else "")
              + (f"; ratio per round {' '.join(f'{x:.2f}' for x in row['ratios'])}" if args.rounds > 1 else ""),
              flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bandwidth": bandwidth, "bandwidth_probes": bandwidths, "llama_cpp_tok_s": peer,
                               "llama_cpp_rounds": peers,
                               "rows": rows, "rounds": runs}, indent=1))


if __name__ == "__main__":
    main()
