"""CPU matmul kernels on SmolLM2's weight shapes, one table: which way of multiplying
by a weight is fastest at each batch size (decode rows) in this run.

Kernels: dense float32 and bfloat16 (`F.linear`), bfloat16 packed for oneDNN (the path
meshserve uses for bf16 on CPU), int8 weight-only (`_weight_int8pack_mm`) and int4
weight-only with groups of 32 (`_weight_int4pack_mm_for_cpu`, the layout GGUF's Q4_1 maps
onto), both as model.quantization runs them (meshserve.layers.quant), and int8 weights x int8 activations quantized per row on the fly (`_int_mm`);
where the CPU has AMX-BF16, meshserve's own AMX product on its tile-packed bf16 weights
(`amx_linear`, what bf16 runs there). Median of several timed runs each; GB/s counts the
weight bytes read once per call. `--kernels` keeps some (e.g. a prefill's rows: `--rows 512
2048 --kernels bf16_packed bf16_amx`).

    python scripts/bench_matmul.py [--rows 1 8 32 512] [--kernels NAME ...] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from meshserve.configs.cpu_features import cpu_features
from meshserve.layers.kernels import cpu_library
from meshserve.layers.matmul import PackedCpuMatmul
from meshserve.layers.quant import Int4Matmul, Int8Matmul

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def timed(fn, repeats: int = 5, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def amx_library():
    """The avx512 build where the CPU multiplies on AMX's bf16 tiles, else None."""
    features = cpu_features()
    return cpu_library.load("avx512") if features.runs("avx512") and features.amx_bf16 else None


def kernels(weight: torch.Tensor, amx=None):
    """name -> (fn(x_float32) -> y, weight bytes); `amx`: the library of the AMX product."""
    n, k = weight.shape
    out = {}
    w32, w16 = weight, weight.bfloat16()
    out["fp32"] = (lambda x: F.linear(x, w32), n * k * 4)
    xb_cache = {}

    def bf16_input(x):
        key = x.data_ptr()
        if key not in xb_cache:
            xb_cache[key] = x.bfloat16()
        return xb_cache[key]

    out["bf16"] = (lambda x: F.linear(bf16_input(x), w16), n * k * 2)
    packed = PackedCpuMatmul(w16)
    out["bf16_packed"] = (lambda x: packed(bf16_input(x)), n * k * 2)
    int8, int4 = Int8Matmul(weight, torch.bfloat16), Int4Matmul(weight, torch.bfloat16)
    out["int8_weight_only"] = (lambda x: int8(bf16_input(x)), n * k)
    out["int4_groups32"] = (lambda x: int4(bf16_input(x)), n * k // 2)
    q8t, scale = int8.codes.t().contiguous(), int8.scale.float()

    def w8a8(x):
        xs = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        xq = (x / xs).round().clamp(-128, 127).to(torch.int8)
        return torch._int_mm(xq, q8t).float() * xs * scale

    out["w8a8_dynamic"] = (w8a8, n * k)
    if amx is not None:
        tiles = amx.ops.amx_pack(w16)
        out["bf16_amx"] = (lambda x: amx.ops.amx_linear(bf16_input(x), tiles, n), n * k * 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", nargs="+", help="only these (default: all this CPU runs)")
    ap.add_argument("--output", default="results/bench_matmul.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    amx = amx_library()
    results = []
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k) * 0.05
        for kernel, (fn, nbytes) in kernels(weight, amx).items():
            if args.kernels and kernel not in args.kernels:
                continue
            for rows in args.rows:
                x = torch.randn(rows, k)
                try:
                    seconds = timed(lambda: fn(x), calls=5 if name == "lm_head" else 20)
                except RuntimeError as e:
                    print(f"{name:8s} {kernel:17s} rows {rows:4d}: unavailable ({str(e)[:60]})")
                    continue
                row = {"shape": name, "kernel": kernel, "rows": rows, "us": seconds * 1e6,
                       "weight_GBps": nbytes / seconds / 1e9, "GFLOPs": 2 * rows * n * k / seconds / 1e9}
                results.append(row)
                print(f"{name:8s} {kernel:17s} rows {rows:4d}: {row['us']:9.1f} us  {row['weight_GBps']:6.1f} GB/s  "
                      f"{row['GFLOPs']:7.1f} GFLOP/s", flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "results": results}, indent=2))
    for rows in args.rows:  # a SmolLM2 layer's four products (the LM head aside), each kernel
        layer = {}
        for r in results:
            if r["rows"] == rows and r["shape"] != "lm_head":
                layer.setdefault(r["kernel"], []).append(r["us"])
        summary = ", ".join(f"{kernel} {sum(us) / 1e3:.2f} ms" for kernel, us in layer.items() if len(us) == 4)
        print(f"a layer's products at {rows} rows: {summary}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
