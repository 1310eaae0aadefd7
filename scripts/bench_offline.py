"""Offline throughput: meshserve's engine vs transformers `generate`, in one run.

SmolLM2-135M-Instruct (the built-in GGUF), fixed-length random prompts, a fixed number
of new tokens (EOS ignored), at several batch sizes and dtypes. Prints tokens/s of
both, their ratio (median of --repeats runs each), and meshserve's MBU (decode) and
MFU (prefill) against the memory bandwidth and matmul peak measured in the same run.

    python scripts/bench_offline.py [--batch-sizes 1 8 32] [--dtypes float32 bfloat16] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import DTYPE_BYTES, plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine.build import build_single_rank_engine
from meshserve.engine.perf import ModelCost, measure_matmul_peak, measure_memory_bandwidth

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 40000, (batch, length), generator=g).tolist()


def run_meshserve(engine, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """Returns (prefill seconds, decode seconds): the first step prefills every prompt."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(i, str(i), p, params)
    start = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    return prefill, time.perf_counter() - start - prefill


@torch.inference_mode()
def run_transformers(model, prompts: list[list[int]], output_len: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                         min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    if out.shape[1] != ids.shape[1] + output_len:
        raise RuntimeError(f"transformers produced {out.shape[1] - ids.shape[1]} tokens, not {output_len}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--output", default="results/bench_offline.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    bandwidth = measure_memory_bandwidth()
    peaks = {d: measure_matmul_peak(DTYPES[d]) for d in args.dtypes}
    print(f"roofline: memory bandwidth {bandwidth / 1e9:.1f} GB/s; matmul peak "
          + ", ".join(f"{d} {p / 1e9:.0f} GFLOP/s" for d, p in peaks.items()), flush=True)

    max_batch, seq_len = max(args.batch_sizes), args.prompt_len + args.output_len
    rows = []
    for dtype in args.dtypes:
        config = load_config(None, [f"model.dtype={dtype}", f"model.max_model_len={seq_len}",
                                    f"scheduler.max_num_seqs={max_batch}",
                                    f"scheduler.max_batched_tokens={max_batch * args.prompt_len}",
                                    f"cache.num_blocks={max_batch * (seq_len // 16 + 1)}"])
        info = check_config(config)
        engine = build_single_rank_engine(config, info, plan_memory(config, info), threads=args.threads)
        cost = ModelCost(info, DTYPE_BYTES[dtype])
        hf = None
        if not args.skip_transformers:
            from transformers import AutoModelForCausalLM

            path = Path(info.path)
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=DTYPES[dtype]).eval()
        for batch in args.batch_sizes:
            prompts = make_prompts(batch, args.prompt_len)
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(run_meshserve(engine, prompts, args.output_len))
                if hf is not None:
                    theirs.append(run_transformers(hf, prompts, args.output_len))
            prefill = statistics.median(p for p, _ in ours)
            decode = statistics.median(d for _, d in ours)
            total = statistics.median(p + d for p, d in ours)
            tokens = batch * args.output_len
            steps = args.output_len - 1
            ctx = args.prompt_len + args.output_len / 2
            bytes_per_step = cost.weight_bytes + batch * ctx * cost.kv_bytes_per_token
            row = {
                "dtype": dtype, "batch": batch,
                "meshserve_tok_s": tokens / total,
                "meshserve_prefill_s": prefill, "meshserve_decode_s": decode,
                "decode_mbu": steps * bytes_per_step / decode / bandwidth,
                "prefill_mfu": batch * cost.flops(args.prompt_len, args.prompt_len) / prefill / peaks[dtype],
            }
            if theirs:
                row["transformers_tok_s"] = tokens / statistics.median(theirs)
                row["ratio"] = row["meshserve_tok_s"] / row["transformers_tok_s"]
            rows.append(row)
            hf_part = f"transformers {row['transformers_tok_s']:7.1f} tok/s  ratio {row['ratio']:5.2f}x  " if theirs else ""
            print(f"{dtype:9s} batch {batch:3d}: meshserve {row['meshserve_tok_s']:7.1f} tok/s  {hf_part}"
                  f"decode MBU {row['decode_mbu']:5.1%}  prefill MFU {row['prefill_mfu']:5.1%}", flush=True)
        del engine, hf

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bandwidth_bytes_s": bandwidth, "matmul_peak_flops": peaks,
                               "prompt_len": args.prompt_len, "output_len": args.output_len,
                               "repeats": args.repeats, "threads": args.threads, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
