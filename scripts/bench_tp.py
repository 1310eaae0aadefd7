"""Tensor parallelism on CPU: meshserve tp=N (one thread per rank) vs tp=1 (N threads),
and vs DeepSpeed AutoTP at tp=N on the same checkpoint and prompts, in one run.

Default model: a random Llama with SmolLM2-135M's shape but 8 heads / 4 KV heads (so tp=2
applies), made once with save_pretrained under results/. `--model smollm2 --tp 3` uses the
real SmolLM2 GGUF at tp=3 instead (DeepSpeed loads the same GGUF through transformers).
Prints tokens/s, the ratios, and meshserve's per-step time split (compute, TP
collectives, control plane, host work); writes JSON.

    python scripts/bench_tp.py [--batch-sizes 1 32] [--tp 2] [--repeats 3] [--no-deepspeed]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import DriverMode, add_batch, random_prompts, add_rank_args, enter_rank_if_asked, run_configuration
from meshserve.configs.model_info import resolve_model_path

HERE = Path(__file__).resolve().parent


def make_tp_checkpoint(directory: Path) -> Path:
    """SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, tied, vocab 49152) with 8 heads of 72
    and 4 KV heads, random weights, SmolLM2's tokenizer."""
    if (directory / "config.json").is_file():
        return directory
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    gguf = resolve_model_path("builtin:smollm2-135m-instruct")
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=72, vocab_size=49152, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(directory))
    return directory


def overrides(args, tp: int, threads: int) -> list[str]:
    seq = args.prompt_len + args.output_len
    top = max(args.batch_sizes)
    return [f"model.path={args.model_path}", f"model.dtype={args.dtype}", f"model.max_model_len={seq}",
            f"parallel.tensor={tp}", f"device.threads={threads}", f"scheduler.max_num_seqs={top}",
            f"scheduler.max_batched_tokens={top * args.prompt_len}", f"cache.num_blocks={top * (seq // 16 + 1)}"]


class BenchMode(DriverMode):
    """The driver's part: run each batch size `repeats` times; record tokens/s and the time split."""

    def measure(self, engine):
        a = self.args
        runner = engine.executor.runner
        rows = []
        for batch in a.batch_sizes:
            prompts = random_prompts(batch, a.prompt_len)
            times, split = [], None
            for _ in range(a.repeats):
                before = self._counters(engine, runner)
                start = time.perf_counter()
                add_batch(engine, prompts, a.output_len)
                while engine.has_work():
                    engine.step()
                times.append(time.perf_counter() - start)
                after = self._counters(engine, runner)
                split = {k: (after[k] - before[k]) for k in after}
            steps = split.pop("steps")
            per_step = {k: 1000 * v / steps for k, v in split.items()}
            rows.append({"batch": batch, "tok_s": batch * a.output_len / statistics.median(times), "seconds": times,
                         "steps": steps, "per_step_ms": per_step})
        return rows

    @staticmethod
    def _counters(engine, runner) -> dict[str, float]:
        s, r = engine.stats, runner.stats
        collectives = runner.groups.tp.timer.seconds
        control = getattr(engine.executor, "control_seconds", 0.0)
        return {"steps": s.steps,
                "step": s.step_seconds,
                "compute": r.forward_seconds + r.sample_seconds - collectives,
                "tp_collectives": collectives,
                "control_plane": control,
                "host": s.schedule_seconds + s.postprocess_seconds + r.prepare_seconds}


def run_meshserve(args, tp: int, threads: int) -> list[dict]:
    extra = ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
             "--repeats", str(args.repeats), "--batch-sizes", *map(str, args.batch_sizes)]
    return run_configuration(HERE / "bench_tp.py", overrides(args, tp, threads), extra)


def run_deepspeed(args, tp: int) -> list[dict]:
    model = Path(args.model_path)
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        env = dict(os.environ, LOCAL_SIZE=str(tp), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
               str(HERE / "peers" / "deepspeed_autotp.py"), "--model", str(model), "--dtype", args.dtype,
               "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
               "--repeats", str(args.repeats), "--output", result.name, "--batch-sizes", *map(str, args.batch_sizes)]
        subprocess.run(cmd, check=True, env=env)
        return json.loads(Path(result.name).read_text())["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tp-shaped", choices=["tp-shaped", "smollm2"])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--output", default="results/bench_tp.json")
    add_rank_args(ap)
    args = ap.parse_args()
    enter_rank_if_asked(HERE / "bench_tp.py", args, BenchMode)

    if args.model == "smollm2":
        args.model_path = resolve_model_path("builtin:smollm2-135m-instruct")
    else:
        args.model_path = make_tp_checkpoint(Path("results") / "bench-tp-model")
    cores = len(os.sched_getaffinity(0))
    single = run_meshserve(args, 1, cores)
    sharded = run_meshserve(args, args.tp, max(1, cores // args.tp))
    peer = None if args.no_deepspeed else run_deepspeed(args, args.tp)
    rows = []
    for i, batch in enumerate(args.batch_sizes):
        row = {"batch": batch, "tp1_tok_s": single[i]["tok_s"], f"tp{args.tp}_tok_s": sharded[i]["tok_s"],
               "tp_ratio": sharded[i]["tok_s"] / single[i]["tok_s"],
               "tp1_per_step_ms": single[i]["per_step_ms"], f"tp{args.tp}_per_step_ms": sharded[i]["per_step_ms"]}
        line = (f"batch {batch:3d}: tp=1 x {cores} threads {single[i]['tok_s']:7.1f} tok/s | tp={args.tp} x "
                f"{max(1, cores // args.tp)} thread(s) {sharded[i]['tok_s']:7.1f} tok/s ({row['tp_ratio']:.2f}x)")
        if peer:
            row["deepspeed_tok_s"] = peer[i]["tok_s"]
            row["vs_deepspeed"] = sharded[i]["tok_s"] / peer[i]["tok_s"]
            line += f" | DeepSpeed AutoTP tp={args.tp} {peer[i]['tok_s']:7.1f} tok/s (meshserve {row['vs_deepspeed']:.2f}x)"
        print(line)
        split = sharded[i]["per_step_ms"]
        print(f"           tp={args.tp} per step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in split.items()))
        rows.append(row)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(args.model_path), "tp": args.tp, "dtype": args.dtype,
                               "prompt_len": args.prompt_len, "output_len": args.output_len,
                               "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
