"""Where a decode step's time goes, on one rank (CPU, or CUDA with --set device.type=cuda):
torch.profiler over steady-state decode steps of a full batch (on CUDA, the kernels' device
time too), and the engine's own split of each step into scheduling, input
preparation, the model's forward, logits + sampling, and postprocessing (detokenizing,
deltas). Host overhead = scheduling + preparation + postprocessing, as a share of the step.

Prints the ops that take the most time (self CPU), the split per step, the host share,
and each op group's share; writes JSON (and a Chrome trace with --trace).

    python scripts/profile_step.py [--batch 32] [--set model.dtype=bfloat16] [--steps 10] [--trace FILE.json]
    python scripts/profile_step.py --prefill --batch 1 --prompt-len 512 --set model.dtype=bfloat16
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine.build import build_single_rank_engine


def split(engine) -> dict[str, float]:
    s, r = engine.stats, engine.executor.runner.stats
    return {"step": s.step_seconds, "schedule": s.schedule_seconds, "prepare": r.prepare_seconds,
            "forward": r.forward_seconds, "sample": r.sample_seconds, "postprocess": s.postprocess_seconds}


GROUPS = {"matmul (linear/mm)": ("aten::linear", "aten::addmm", "aten::mm", "mkldnn::_linear_pointwise",
                                  "aten::matmul", "aten::bmm"),
          "quantized matmul (int4/int8/w8a8)": ("aten::_weight_int4pack_mm", "aten::_weight_int8pack_mm",
                                                "aten::_int_mm", "meshserve::int8_dynamic_linear",
                                                "onednn::qlinear_pointwise", "meshserve::w8a8_matmul",
                                                "meshserve_cpu::w8a8_linear"),
          "C++ row ops (quantize, norm, act, argmax)": ("meshserve_cpu::quantize_rows_u8", "meshserve_cpu::scale_rows_",
                                                        "meshserve_cpu::rms_norm", "meshserve_cpu::silu_and_mul",
                                                        "meshserve_cpu::argmax_rows"),
          "attention (sdpa, cpu kernel)": ("aten::_scaled_dot_product", "aten::scaled_dot_product_attention",
                                           "meshserve_cpu::paged_decode_attention"),
          "kv cache (index/copy)": ("aten::index_select", "aten::index_copy_", "aten::index", "aten::copy_"),
          "compiled graph's own kernels": ("## Call CompiledFxGraph",),
          "torch.compile guards": ("TorchDynamo Cache Lookup",)}


def op_name(key: str) -> str:
    """The profiler's op name with the C++ kernels' build dropped (meshserve_cpu_avx2::x -> meshserve_cpu::x)."""
    return re.sub(r"^meshserve_cpu_[a-z0-9]+::", "meshserve_cpu::", key)


def op_group_shares(prof) -> dict[str, float]:
    """Each op group's share of the profiled self CPU time."""
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    return {name: (sum(e.self_cpu_time_total for e in events if op_name(e.key).startswith(prefixes)) / total_us
                   if total_us else 0.0) for name, prefixes in GROUPS.items()}


def profile_prefill(engine, args, prompts, params) -> None:
    """--prefill: one step prefilling every prompt, after a throwaway one of the same size
    (other tokens: the prefix cache would serve the same prompts)."""
    for round_ in ("warm-up", "profiled"):
        for i, p in enumerate(prompts):
            engine.add_request((round_, i), f"{round_}-{i}", [t + 1 for t in p] if round_ == "warm-up" else p, params)
        if round_ == "profiled":
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - start
        else:
            engine.step()
        for i in range(len(prompts)):
            engine.abort((round_, i))
        while engine.has_work():
            engine.step()
    shares = op_group_shares(prof)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(f"prefill of {args.batch} x {args.prompt_len} tokens: {1000 * seconds:.0f} ms under the profiler")
    print("self CPU time by op group: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items()))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prefill": True, "batch": args.batch, "prompt_len": args.prompt_len,
                               "overrides": args.overrides, "seconds": seconds, "op_group_share": shares}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="decode steps profiled")
    ap.add_argument("--timed-steps", type=int, default=40, help="decode steps timed without the profiler")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--trace", default=None, help="write a Chrome trace here")
    ap.add_argument("--prefill", action="store_true",
                    help="profile one step prefilling --batch prompts of --prompt-len tokens instead")
    ap.add_argument("--output", default="results/profile_step.json")
    args = ap.parse_args()

    config = load_config(None, ["device.compile_wait=true", *args.overrides])  # compiled steps from the first
    info = check_config(config)
    engine = build_single_rank_engine(config, info, plan_memory(config, info), threads=args.threads)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 40000, (args.batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    if args.prefill:
        profile_prefill(engine, args, prompts, params)
        return
    for i, p in enumerate(prompts):
        engine.add_request(i, str(i), p, params)
    for _ in range(5):  # prefill, then a few decode steps to warm up
        engine.step()

    before = split(engine)
    times = []
    for _ in range(args.timed_steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    after = split(engine)
    per_step = {k: 1000 * (after[k] - before[k]) / args.timed_steps for k in after}
    host = per_step["schedule"] + per_step["prepare"] + per_step["postprocess"]

    cuda = config.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 record_shapes=True) as prof:
        for _ in range(args.steps):
            engine.step()
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=15)
    device_ms = sum(e.self_device_time_total for e in averages) / 1e3 / args.steps if cuda else None
    if args.trace:
        prof.export_chrome_trace(args.trace)
    shares = op_group_shares(prof)

    print(f"model {config.model.path}, dtype {config.torch_dtype_name}, batch {args.batch}, "
          f"{args.threads} threads; {args.timed_steps} decode steps timed, {args.steps} profiled")
    print(table)
    print(f"per decode step (median {1000 * statistics.median(times):.1f} ms): "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in per_step.items()))
    print(f"host overhead (schedule + prepare + postprocess): {host:.2f} ms = {100 * host / per_step['step']:.1f}% "
          f"of the step; decode {args.batch * 1000 / per_step['step']:.0f} tok/s")
    print("self CPU time by op group: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items()))
    if cuda:  # under the profiler, each step's kernels against the step
        print(averages.table(sort_by="self_device_time_total", row_limit=15))
        print(f"device (kernel) time per step {device_ms:.2f} ms of a {statistics.median(times) * 1000:.2f} ms step")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"batch": args.batch, "dtype": config.torch_dtype_name, "overrides": args.overrides,
                               "per_step_ms": per_step, "median_step_ms": 1000 * statistics.median(times),
                               "host_ms": host, "host_share": host / per_step["step"], "op_group_share": shares,
                               "device_ms_per_step": device_ms}, indent=1))


if __name__ == "__main__":
    main()
