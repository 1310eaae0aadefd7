"""Pipeline parallelism on CPU: stage occupancy at steady decode with one micro-batch
in flight and with one per stage, and throughput of pp=2 against pp=1 on the same cores.

SmolLM2-135M-Instruct (30 layers: 15 + 15), a batch of fixed-length random prompts,
a fixed number of new tokens (EOS ignored). Occupancy of a stage = the time it computes
(its waits for the other stage excluded) over the wall time of the decode phase.

    python scripts/bench_pp.py [--batch 32] [--repeats 3] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench_common import DriverMode, add_batch, random_prompts, add_rank_args, enter_rank_if_asked, run_configuration

HERE = Path(__file__).resolve().parent


def overrides(args, pp: int, micro_batches: int, threads: int) -> list[str]:
    seq = args.prompt_len + args.output_len
    return [f"model.dtype={args.dtype}", f"model.max_model_len={seq}", f"parallel.pipeline={pp}",
            f"parallel.micro_batches={micro_batches}", f"device.threads={threads}",
            f"scheduler.max_num_seqs={args.batch}", f"scheduler.max_batched_tokens={args.batch * args.prompt_len}",
            f"cache.num_blocks={args.batch * (seq // 16 + 1)}"]


class OccupancyMode(DriverMode):
    def measure(self, engine):
        a = self.args
        runs = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            add_batch(engine, random_prompts(a.batch, a.prompt_len), a.output_len)
            while any(len(s.seq.output_token_ids) < 4 for s in engine.requests.values()):
                engine.step()  # prefill, and a few decode steps so that every rank has reported
            decode_start, before = time.perf_counter(), engine.executor.rank_stats()
            steps_before = engine.stats.steps
            while engine.has_work():
                engine.step()
            end, after = time.perf_counter(), engine.executor.rank_stats()
            occupancy = {r: (after[r].busy_seconds - before[r].busy_seconds)
                         / max(1e-9, after[r].wall_seconds - before[r].wall_seconds)
                         for r in after if r in before}
            runs.append({"tok_s": a.batch * a.output_len / (end - start),
                         "decode_tok_s": a.batch * (a.output_len - 4) / (end - decode_start),
                         "decode_steps": engine.stats.steps - steps_before, "occupancy": occupancy})
        return runs


def summarize(runs: list[dict]) -> dict:
    ranks = sorted(runs[0]["occupancy"], key=int)
    return {"tok_s": statistics.median(r["tok_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "occupancy": {r: statistics.median(run["occupancy"][r] for run in runs) for r in ranks}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="results/bench_pp.json")
    add_rank_args(ap)
    args = ap.parse_args()
    enter_rank_if_asked(HERE / "bench_pp.py", args, OccupancyMode)

    cores = len(os.sched_getaffinity(0))
    extra = ["--batch", str(args.batch), "--dtype", args.dtype, "--prompt-len", str(args.prompt_len),
             "--output-len", str(args.output_len), "--repeats", str(args.repeats)]
    configs = {"pp1": (1, 1, cores), "pp2_m1": (2, 1, max(1, cores // 2)), "pp2_m2": (2, 2, max(1, cores // 2))}
    results = {name: summarize(run_configuration(HERE / "bench_pp.py", overrides(args, *c), extra))
               for name, c in configs.items()}
    base = results["pp1"]["tok_s"]
    for name, r in results.items():
        occ = ", ".join(f"stage {i} {v:.0%}" for i, v in enumerate(r["occupancy"].values()))
        print(f"{name:7s}: {r['tok_s']:7.1f} tok/s ({r['tok_s'] / base:.2f}x pp1), decode {r['decode_tok_s']:7.1f} "
              f"tok/s; occupancy during decode: {occ}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"batch": args.batch, "dtype": args.dtype, "prompt_len": args.prompt_len,
                               "output_len": args.output_len, "repeats": args.repeats, "cores": cores,
                               "configs": {k: list(v) for k, v in configs.items()}, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
