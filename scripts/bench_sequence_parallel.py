"""Sequence parallelism on CPU: the peak activation memory and the time of one long prefill
step (default 8190 tokens) at tensor parallelism tp, with parallel.sequence_parallel and
without it, in one run.

Each configuration runs through meshserve's own launcher (one process per rank, one thread
each). Its driver (tp rank 0) first prefills one prompt of the same length (the warm-up: the
kernels' one-time costs, and every KV block the measured prompts will use is touched), then
per round a prompt new to it (prefix caching off): it resets its peak resident size
(/proc/self/clear_refs), runs the one prefill step, and reads the peak (VmHWM) less the
resident size before the step. glibc hands every allocation above 64 KiB its own mapping
(MALLOC_MMAP_THRESHOLD_, set for the ranks), returned on free, so the peak resident size
follows the peak of the live tensors; weights, the KV cache and the shared-memory segment
were resident before the step.

The prediction (the design's factor), per token and rank in elements of the activations'
dtype, with hidden H, local query width q = heads/tp * head_dim, local KV width k, local MLP
width i = intermediate/tp, at each point of a decoder layer: the stream tensors of width H
(the layer loop's hidden and residual, and the layer's own: 4 while a block runs, 6 while
the second norm returns its pair) are whole on every rank without sequence parallelism and
H/tp with it; beside them a block holds its own: the QKV product (q + 2k), the attention
output (q), a row-parallel product's partial sums (H, and with sequence parallelism the
reduce-scatter's H/tp rows), the MLP's gate/up product (2i) and activation (i), and with
sequence parallelism a column-parallel product's all-gathered input (H) while it runs. The
predicted peak is the largest point's total; the factor is the peak without over the peak
with, printed beside the measured one.

    python scripts/bench_sequence_parallel.py [--tp 3] [--tokens 8190] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench_common import DriverMode, add_batch, add_rank_args, enter_rank_if_asked, random_prompts, run_configuration
from meshserve.configs.model_info import read_model_info, resolve_model_path

HERE = Path(__file__).resolve().parent
BLOCK = 16


def overrides(args, sequence_parallel: bool) -> list[str]:
    blocks = -(-(args.tokens + 1) // BLOCK) + 1  # one prompt at a time, its blocks reused every round
    return [f"model.path={args.model_path}", f"model.dtype={args.dtype}", f"parallel.tensor={args.tp}",
            f"parallel.sequence_parallel={str(sequence_parallel).lower()}", "device.threads=1",
            f"model.max_model_len={args.tokens + 1}", "scheduler.max_num_seqs=1",
            f"scheduler.max_batched_tokens={args.tokens}", f"cache.block_size={BLOCK}", f"cache.num_blocks={blocks}",
            "cache.prefix_caching=false"]


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class PrefillMode(DriverMode):
    """The driver's part: per round, the prefill step's time and peak resident growth."""

    def measure(self, engine):
        a = self.args
        sp = engine.executor.runner.model.model.sp
        add_batch(engine, random_prompts(1, a.tokens, seed=999), 1)
        while engine.has_work():
            engine.step()
        timer = engine.executor.runner.groups.tp.timer
        rows = []
        for r in range(a.rounds):
            add_batch(engine, random_prompts(1, a.tokens, seed=r), 1)
            Path("/proc/self/clear_refs").write_text("5")
            before = _status("VmRSS")
            comm, calls = timer.seconds, timer.calls
            start = time.perf_counter()
            while engine.has_work():
                engine.step()
            rows.append({"seconds": time.perf_counter() - start, "peak_bytes": _status("VmHWM") - before,
                         "collective_seconds": timer.seconds - comm, "collectives": timer.calls - calls})
        return {"rounds": rows, "steps_split": sp.steps_split if sp is not None else 0}


def predicted_peak(info, tp: int, sequence_parallel: bool) -> float:
    """The largest live set of a decoder layer's points, per token (see the module's text)."""
    h, d = info.hidden_size, info.head_dim
    q = info.num_attention_heads // tp * d
    k = max(1, info.num_key_value_heads // tp) * d
    i = info.intermediate_size // tp
    stream = h / tp if sequence_parallel else h
    gathered = h if sequence_parallel else 0
    scattered = h / tp if sequence_parallel else 0
    points = [
        4 * stream + gathered + q + 2 * k,            # the QKV product
        4 * stream + q + 2 * k + q,                   # attention
        4 * stream + q + 2 * k + q + h + scattered,   # o_proj and its reduction
        6 * stream,                                   # the second norm
        4 * stream + gathered + 2 * i,                # the gate/up product
        4 * stream + 2 * i + i,                       # the activation
        4 * stream + i + h + scattered,               # down_proj and its reduction
    ]
    return max(points)


def predicted_factor(info, tp: int) -> dict[str, float]:
    without, with_sp = predicted_peak(info, tp, False), predicted_peak(info, tp, True)
    return {"without": without, "with": with_sp, "factor": without / with_sp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8190)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", default="results/bench_sequence_parallel.json")
    add_rank_args(ap)
    args = ap.parse_args()
    args.model_path = str(resolve_model_path(args.model))
    enter_rank_if_asked(Path(__file__), args, PrefillMode)

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)  # the ranks inherit it
    passed = ["--tp", str(args.tp), "--tokens", str(args.tokens), "--dtype", args.dtype, "--rounds", str(args.rounds),
              "--model", args.model]
    runs = {}
    for sequence_parallel in (False, True):
        name = "sequence_parallel" if sequence_parallel else "plain"
        runs[name] = run_configuration(Path(__file__), overrides(args, sequence_parallel), passed)
    summary = {}
    for name, run in runs.items():
        rounds = run["rounds"]
        summary[name] = {"seconds": statistics.median(r["seconds"] for r in rounds),
                         "peak_mib": statistics.median(r["peak_bytes"] for r in rounds) / 2**20,
                         "collective_seconds": statistics.median(r["collective_seconds"] for r in rounds),
                         "collectives": rounds[0]["collectives"],
                         "steps_split": run["steps_split"]}
    plain, split = summary["plain"], summary["sequence_parallel"]
    prediction = predicted_factor(read_model_info(args.model_path), args.tp)
    result = {"model": args.model, "tp": args.tp, "tokens": args.tokens, "dtype": args.dtype, "runs": runs,
              "summary": summary, "predicted": prediction,
              "measured_factor": plain["peak_mib"] / split["peak_mib"],
              "time_ratio": split["seconds"] / plain["seconds"]}
    print(f"{args.tokens}-token prefill at tp={args.tp} ({args.dtype}), medians of {args.rounds} rounds:")
    for name, row in summary.items():
        print(f"  {name:17s} {row['seconds']:7.2f} s ({row['collective_seconds']:5.2f} s in {row['collectives']} "
              f"TP collectives)   peak activations {row['peak_mib']:7.1f} MiB (steps split: {row['steps_split']})")
    print(f"  peak activation memory: {result['measured_factor']:.2f}x lower with sequence parallelism "
          f"(predicted {prediction['factor']:.2f}x: {prediction['without']:.0f} vs {prediction['with']:.0f} "
          f"elements per token)")
    print(f"  time with / without: {result['time_ratio']:.3f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
