"""One stream on the CPU: meshserve's engine vs llama.cpp in-process (llama-cpp-python, the
same GGUF, its own Q4_1 weights and AMX kernels), in one run; with meshserve's batch-1
decode MBU and 512-token prefill MFU against the bandwidth and matmul peak measured here.

meshserve runs in each --variants dtype[:model.quantization[:compile]] (int4 keeps the
GGUF's own Q4_1 codes, MBU then counts the quantized bytes; compile: device.compile=true,
its start-up compile time printed). Each side prefills a 128-token prompt
and then decodes --output-len tokens one at a time (llama.cpp: `Llama.eval` of one token per step; meshserve: engine steps, EOS ignored).
Prints tok/s, the ratio to llama.cpp, MBU, MFU; median of --repeats; writes JSON.

    pip install 'llama-cpp-python[server]'
    python scripts/bench_cpu.py [--variants float32 bfloat16 bfloat16:int4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
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
from meshserve.engine.bootstrap import build_single_rank_engine
from meshserve.engine.perf import ModelCost, measure_matmul_peak, measure_memory_bandwidth

HERE = Path(__file__).resolve().parent


def llama_cpp_decode(gguf: str, prompt: list[int], output_len: int, threads: int) -> float:
    """Decode tok/s of llama.cpp in this process (after prefilling `prompt`)."""
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


def prefill_seconds(engine, length: int) -> float:
    engine.add_request("prefill", "prefill", make_prompts(1, length, seed=1)[0],
                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["float32", "bfloat16", "bfloat16:int8", "bfloat16:int4",
                                                      "bfloat16:none:compile", "bfloat16:int4:compile"],
                    help="dtype[:model.quantization[:compile]] of each meshserve run (compile: device.compile=true)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default="results/bench_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    prompt = make_prompts(1, args.prompt_len)[0]
    bandwidth = measure_memory_bandwidth()
    gguf = str(resolve_model_path("builtin:smollm2-135m-instruct"))
    peer = statistics.median(llama_cpp_decode(gguf, prompt, args.output_len, args.threads)
                             for _ in range(args.repeats))
    print(f"roofline: memory bandwidth {bandwidth / 1e9:.1f} GB/s; llama.cpp in-process (Q4_1): {peer:.1f} tok/s")
    rows = []
    for variant in args.variants:
        dtype, quantization, *flags = variant.split(":") + ["none"]
        if dtype not in DTYPES or any(f not in ("compile", "none") for f in flags):
            ap.error(f"--variants {variant}: expected dtype[:quantization[:compile]], dtype one of {', '.join(DTYPES)}")
        config = load_config(None, [f"model.dtype={dtype}", f"model.quantization={quantization}",
                                    "model.max_model_len=1024", f"device.compile={'compile' in flags}"])
        info = check_config(config)
        built = time.perf_counter()
        engine = build_single_rank_engine(config, info, plan_memory(config, info), threads=args.threads)
        build_seconds = time.perf_counter() - built
        compiled = engine.executor.runner.compiled
        compile_seconds = compiled.compile_seconds if compiled else 0.0
        cost = ModelCost(info, DTYPE_BYTES[dtype], quantization)
        peak = measure_matmul_peak(DTYPES[dtype])
        decode = statistics.median(args.output_len / run_meshserve(engine, [prompt], args.output_len)[1]
                                   for _ in range(args.repeats))
        prefill = statistics.median(prefill_seconds(engine, args.prefill_len) for _ in range(args.repeats))
        ctx = args.prompt_len + args.output_len // 2
        mbu = decode * (cost.weight_bytes + ctx * cost.kv_bytes_per_token) / bandwidth
        mfu = cost.flops(args.prefill_len, args.prefill_len) / prefill / peak
        rows.append({"variant": variant, "dtype": dtype, "quantization": quantization, "compile": compiled is not None,
                     "compile_seconds": compile_seconds, "build_seconds": build_seconds,
                     "compiled_steps": compiled.steps if compiled else 0, "decode_tok_s": decode,
                     "ratio_to_llama_cpp": decode / peer, "decode_mbu": mbu, "prefill_seconds": prefill,
                     "prefill_mfu": mfu, "matmul_peak": peak})
        print(f"meshserve {variant:<22} one stream {decode:6.1f} tok/s ({decode / peer:.2f}x llama.cpp)  decode MBU "
              f"{100 * mbu:.1f}%  {args.prefill_len}-token prefill {1000 * prefill:.0f} ms, MFU {100 * mfu:.1f}% "
              f"of {peak / 1e9:.0f} GFLOP/s" + (f"; compiled in {compile_seconds:.0f} s" if compiled else ""))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bandwidth": bandwidth, "llama_cpp_tok_s": peer, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
