"""The sampler's cost for one decode step's batch: ms per call of `Sampler` on (batch, vocab)
float32 logits, greedy, temperature 1.0, temperature 0.7 + top-p 0.9, and top-k 50, on the
C++ path (cpu_sample.cpp) and on the torch-op path, side by side in one run (medians over
--repeats calls, after a warm-up). The logits are SmolLM2's for real prompts: one prefill
of a few prompts, rows drawn from its positions, so the distributions are as peaked as a
model's (random normal logits are much flatter and make top-p cost more).

    python scripts/bench_sampler.py [--batch 32] [--repeats 50] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine.build import build_single_rank_engine
from meshserve.layers.kernels import cpu_library
from meshserve.layers.sampler import Sampler, SamplingRow

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"greedy": dict(temperature=0.0), "temperature 1.0": dict(temperature=1.0),
            "temperature 0.7 + top_p 0.9": dict(temperature=0.7, top_p=0.9), "top_k 50": dict(top_k=50)}


def model_logits(batch: int) -> torch.Tensor:
    """`batch` rows of SmolLM2's logits at positions of a real text."""
    config = load_config(None, ["model.max_model_len=1024", "cache.memory=64MiB"])
    info = check_config(config)
    engine = build_single_rank_engine(config, info, plan_memory(config, info))
    ids = engine.tokenizer.encode((REPO / "scripts" / "data" / "perplexity.txt").read_text())[:512]
    runner = engine.executor.runner
    meta = runner.model.backend.build_metadata([len(ids)], [len(ids)], [list(range(-(-len(ids) // 16)))], 16)
    with torch.inference_mode():
        hidden, _ = runner.model(torch.tensor(ids), torch.arange(len(ids)), runner.kv_caches, meta)
        logits = runner.model.compute_logits(hidden).float()
    rows = torch.linspace(8, len(ids) - 1, batch).long()
    return logits[rows].contiguous()


def time_sampler(logits: torch.Tensor, params: SamplingParams, repeats: int, library) -> float:
    """`library`: the C++ kernels that sample (cpu_library.load), None: the torch ops."""
    sampler = Sampler((2,), seed=0, library=library)
    rows = [SamplingRow(params, 100 + i, 50, [0] * (100 + i)) for i in range(len(logits))]
    for _ in range(3):
        sampler(logits.clone(), rows)
    times = []
    for _ in range(repeats):
        x = logits.clone()
        start = time.perf_counter()
        sampler(x, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "results" / "bench_sampler.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logits = model_logits(args.batch)
    results: dict[str, dict[str, float]] = {}
    library = cpu_library.load()
    print(f"Sampler on ({args.batch}, {logits.shape[1]}) float32 logits, {args.threads} threads, median ms per call")
    print(f"{'setting':<30}{'C++':>10}{'torch ops':>12}")
    for name, kwargs in SETTINGS.items():
        params = SamplingParams(**kwargs)
        row = {"C++": time_sampler(logits, params, args.repeats, library),
               "torch ops": time_sampler(logits, params, args.repeats, None)}
        results[name] = row
        print(f"{name:<30}{row['C++']:>10.2f}{row['torch ops']:>12.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"batch": args.batch, "vocab": logits.shape[1], "threads": args.threads,
                               "ms_per_call": results}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
