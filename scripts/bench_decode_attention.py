"""Paged decode attention on the CPU, one decode step's call per layer: meshserve's C++ op
(layers/kernels/cpu_decode_attention.cpp, the build this CPU selects) against torch
(the cache gathered through the block tables, then SDPA), SmolLM2's heads (9 query heads,
3 KV heads of 64), 16-token blocks scattered over a cache far larger than the CPU's caches.

Both run alternately, --calls times per case, each call after reading a 96 MB buffer (as a
decode step's weight products leave the caches between two layers' attention; --warm: not,
so the cache may stay in L3); prints the median microseconds per call, the rate the cache is
read at, and torch's time over meshserve's. Writes JSON.

    python scripts/bench_decode_attention.py [--batch 1 8 32] [--context 180 512] [--calls 60] [--warm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from meshserve.configs.cpu_features import cpu_features
from meshserve.layers.host_memory import zeros_on_touch
from meshserve.layers.kernels import cpu_library

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def case(batch: int, context: int, dtype: torch.dtype, blocks: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k_cache = zeros_on_touch((blocks, BLOCK, KV_HEADS, DIM), dtype)  # as the engine allocates it
    v_cache = zeros_on_touch((blocks, BLOCK, KV_HEADS, DIM), dtype)
    k_cache.copy_(torch.randn(k_cache.shape, generator=g))
    v_cache.copy_(torch.randn(v_cache.shape, generator=g))
    width = -(-context // BLOCK)
    tables = torch.randperm(blocks, generator=g)[:batch * width].view(batch, width)
    q = torch.randn(batch, HEADS, DIM, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.full((batch,), context, dtype=torch.long)


def torch_decode(q, k_cache, v_cache, tables, lens, scale):
    n, context = q.shape[0], int(lens[0])
    k = k_cache[tables].reshape(n, -1, KV_HEADS, DIM)[:, :context].transpose(1, 2)
    v = v_cache[tables].reshape(n, -1, KV_HEADS, DIM)[:, :context].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[180, 512])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--cache-blocks", type=int, default=8192, help="blocks in the cache (8192: 100 MB per K or V)")
    p.add_argument("--warm", action="store_true", help="no buffer read between calls")
    p.add_argument("--output", default="results/bench_decode_attention.json")
    args = p.parse_args()
    library = cpu_library.load("auto")
    if library is None:
        raise SystemExit("meshserve's C++ kernels could not be built here")
    op = library.ops.paged_decode_attention
    scale = DIM ** -0.5
    flush = None if args.warm else torch.ones(24 << 20)
    print(f"CPU: {cpu_features().describe()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads; "
          f"build {library.isa}; cache {'warm' if args.warm else 'read from memory'}")
    print(f"{'dtype':<9}{'batch':>6}{'context':>8}{'meshserve us':>14}{'torch us':>10}{'GB/s':>7}{'torch / ms':>11}")
    rows = []
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for batch in args.batch:
            for context in args.context:
                inputs = case(batch, context, dtype, args.cache_blocks)
                ours, reference = op(*inputs, scale), torch_decode(*inputs, scale)
                err = (ours.float() - reference.float()).abs().max().item()
                times = {"meshserve": [], "torch": []}
                for _ in range(args.calls):
                    for name, fn in (("meshserve", op), ("torch", torch_decode)):
                        if flush is not None:
                            flush.sum()
                        start = time.perf_counter()
                        fn(*inputs, scale)
                        times[name].append(time.perf_counter() - start)
                ms, ts = statistics.median(times["meshserve"]), statistics.median(times["torch"])
                cache_bytes = 2 * batch * context * KV_HEADS * DIM * dtype.itemsize
                row = {"dtype": dtype_name, "batch": batch, "context": context, "meshserve_us": ms * 1e6,
                       "torch_us": ts * 1e6, "cache_gb_per_s": cache_bytes / ms / 1e9, "torch_over_meshserve": ts / ms,
                       "max_abs_diff": err}
                rows.append(row)
                print(f"{dtype_name:<9}{batch:>6}{context:>8}{ms * 1e6:>14.0f}{ts * 1e6:>10.0f}"
                      f"{row['cache_gb_per_s']:>7.1f}{ts / ms:>10.2f}x")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_features().describe(), "build": library.isa,
                               "warm": args.warm, "rows": rows},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
