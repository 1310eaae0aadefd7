"""The products of one decode step, streamed from memory as a step streams them: every
layer's QKV, o, gate/up and down weights of SmolLM2's 30 layers and the tied 49,152-row head
(538 MB in float32, far past the caches), multiplied in order by `--rows` input rows.

Each kernel's pass over all the weights is timed against a sum over the same weights (the
rate at which this machine reads them, `torch.sum` one matrix at a time) and a read-bandwidth
probe (the one decode MBU is taken against, engine.perf), all interleaved in one process,
medians of --rounds. Kernels: meshserve's product (layers/kernels/cpu_dense_linear.cpp, the
weights in its panels) in each vector build this CPU runs (avx512, avx2) on float32 and bf16
weights, and oneDNN's float32 `F.linear`, on the weight as stored and packed once into its
blocked layout (layers/matmul.py PackedCpuMatmul). Where the CPU has AMX-BF16 also
meshserve's AMX product (layers/kernels/cpu_amx_linear.cpp) on bf16 rows, and, where oneDNN
multiplies bf16, oneDNN's packed bf16 product (what bf16 models took before the AMX product,
and vLLM's CPU build's).

    python scripts/bench_decode_products.py [--rows 1 32] [--rounds 15] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from meshserve.engine.perf import measure_memory_bandwidth
from meshserve.configs.cpu_features import cpu_features
from meshserve.layers.kernels import cpu_library
from meshserve.layers.matmul import AmxCpuMatmul, PackedCpuMatmul
from meshserve.layers.matmul_plan import onednn_packs

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)
LAYERS = 30


def model_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    weights = [torch.randn(*shape).mul_(0.05).to(dtype) for _ in range(LAYERS) for shape in LAYER_SHAPES]
    return weights + [torch.randn(*HEAD_SHAPE).mul_(0.05).to(dtype)]


def passes(rows: int, builds: dict) -> dict:
    """name -> (fn() running one pass, bytes read); `builds`: ISA -> its kernel library."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        weights = model_weights(dtype)
        inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        tag = str(dtype).removeprefix("torch.")
        for isa, ops in builds.items():
            panels = [ops.pack_panels(w) for w in weights]
            out[f"meshserve_{isa}_{tag}"] = ((lambda ps=panels, xs=inputs, op=ops.dense_linear:
                                              [op(xs[p.shape[1]], p) for p in ps]), nbytes)
        if dtype == torch.bfloat16:
            rows16 = {k: x.bfloat16() for k, x in inputs.items()}
            if "avx512" in builds and cpu_features().amx_bf16:
                library = cpu_library.CpuLibrary("avx512", builds["avx512"])
                amx = [(AmxCpuMatmul(w, library), rows16[w.shape[1]]) for w in weights]
                out["meshserve_amx_bfloat16"] = ((lambda pairs=amx: [p(x) for p, x in pairs]), nbytes)
            if onednn_packs(dtype):
                packed16 = [(PackedCpuMatmul(w), rows16[w.shape[1]]) for w in weights]
                out["onednn_packed_bfloat16"] = ((lambda pairs=packed16: [p(x) for p, x in pairs]), nbytes)
        if dtype == torch.float32:
            out["onednn_float32"] = ((lambda ws=weights, xs=inputs: [F.linear(xs[w.shape[1]], w) for w in ws]), nbytes)
            packed = [PackedCpuMatmul(w) for w in weights]
            out["onednn_packed_float32"] = ((lambda ps=packed, xs=inputs: [p(xs[p.packed.shape[1]]) for p in ps]),
                                            nbytes)
        out[f"sum_{tag}"] = ((lambda ws=weights: [w.sum() for w in ws]), nbytes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default="results/bench_decode_products.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    builds = {isa: cpu_library.library(isa) for isa in ("avx512", "avx2") if isa in cpu_library.runnable_isas()}
    results = []
    for rows in args.rows:
        kernels = passes(rows, builds)
        times = {name: [] for name in kernels}
        probes = []
        for fn, _ in kernels.values():
            fn()
        for _ in range(args.rounds):
            probes.append(measure_memory_bandwidth())
            for name, (fn, _) in kernels.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        probe = statistics.median(probes)
        print(f"rows {rows}: read-bandwidth probe {probe / 1e9:.1f} GB/s (median of {args.rounds})")
        for name, (_, nbytes) in kernels.items():
            seconds = statistics.median(times[name])
            sum_seconds = statistics.median(times["sum_" + name.rsplit("_", 1)[1]])
            row = {"rows": rows, "kernel": name, "ms": seconds * 1e3, "GBps": nbytes / seconds / 1e9,
                   "of_sum": sum_seconds / seconds, "of_probe": nbytes / seconds / probe,
                   "GFLOPs": 2 * rows * nbytes / (4 if "float32" in name else 2) / seconds / 1e9}
            results.append(row)
            print(f"  {name:24s} {row['ms']:7.2f} ms  {row['GBps']:5.1f} GB/s  {100 * row['of_sum']:5.1f}% of the sum's "
                  f"rate  {100 * row['of_probe']:5.1f}% of the probe  {row['GFLOPs']:6.1f} GFLOP/s", flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
