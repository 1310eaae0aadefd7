"""Mixture of experts on CPU: a random Qwen3-MoE (8 experts, top-2, hidden 512) decoding at
batch 1 and 32, meshserve against transformers in the same run, and expert parallelism
ep=2 (one thread per rank; parallel.expert_exchange all_to_all and all_reduce) against ep=1
(all the cores in one rank) on the same cores.

The model (made once with save_pretrained under results/, SmolLM2's tokenizer): 8 layers,
hidden 512, 8 heads of 64 and 4 KV heads, 8 experts of 1024 per layer, top-2 with the
top-k probabilities renormalized, vocabulary 49152, float32. Each configuration prefills
`batch` random prompts of --prompt-len tokens in one step, then decodes --output-len
tokens; the decode step time is the median over the decode steps (each sequence gains one
token per step, so tok/s = batch / step time). transformers runs the same prompts with its
KV cache, one forward per step, in this process with the same threads. meshserve runs
through its own launcher (one process per rank). ep=2 splits out the time its driver spent
in the expert group's exchanges (all-to-all and all-gather) per step. Rounds alternate the
order of the three; medians of the per-round figures are printed and written as JSON.

    python scripts/bench_moe.py [--batch-sizes 1 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_common import DriverMode, add_batch, add_rank_args, enter_rank_if_asked, random_prompts, run_configuration
from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.model_info import resolve_model_path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def make_moe_checkpoint(directory: Path) -> Path:
    if (directory / "config.json").is_file():
        return directory
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    gguf = resolve_model_path("builtin:smollm2-135m-instruct")
    config = Qwen3MoeConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
                            intermediate_size=2048, norm_topk_prob=True, vocab_size=49152, max_position_embeddings=2048,
                            tie_word_embeddings=True, initializer_range=0.05)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(directory))
    return directory


def overrides(args, ep: int, threads: int, exchange: str = "all_to_all") -> list[str]:
    seq = args.prompt_len + args.output_len
    top = max(args.batch_sizes)
    return [f"model.path={args.model_path}", f"model.max_model_len={seq}", f"parallel.expert={ep}",
            f"parallel.expert_exchange={exchange}",
            f"device.threads={threads}", f"scheduler.max_num_seqs={top}",
            f"scheduler.max_batched_tokens={max(top * args.prompt_len, 2048)}",
            f"cache.num_blocks={top * (seq // 16 + 1)}", "cache.prefix_caching=false"]


class BenchMode(DriverMode):
    """The driver's part: per batch size, the median decode step and the expert group's
    exchange time per decode step (this rank's)."""

    def measure(self, engine):
        a = self.args
        runner = engine.executor.runner
        rows = []
        for batch in a.batch_sizes:
            prompts = random_prompts(batch, a.prompt_len, seed=batch)
            add_batch(engine, prompts, 4)  # warm-up: the first steps of a shape pay one-time costs
            while engine.has_work():
                engine.step()
            add_batch(engine, prompts, a.output_len)
            engine.step()  # the prefill step
            steps, exchange = [], 0.0
            while engine.has_work():
                before = runner.groups.ep.timer.seconds
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
                exchange += runner.groups.ep.timer.seconds - before
            step = statistics.median(steps)
            rows.append({"batch": batch, "step_ms": 1000 * step, "tok_s": batch / step,
                         "ep_exchange_ms_per_step": 1000 * exchange / len(steps), "decode_steps": len(steps)})
        return rows


@torch.inference_mode()
def run_transformers(args, threads: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(args.model_path), dtype=torch.float32).eval()
    rows = []
    for batch in args.batch_sizes:
        ids = torch.tensor(random_prompts(batch, args.prompt_len, seed=batch))
        for decode_steps in (4, args.output_len - 1):  # a warm-up, then the measured run
            out = model(ids, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            steps = []
            for _ in range(decode_steps):
                start = time.perf_counter()
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                steps.append(time.perf_counter() - start)
        step = statistics.median(steps)
        rows.append({"batch": batch, "step_ms": 1000 * step, "tok_s": batch / step})
    return rows


def roofline_floors(args, cores: int) -> dict:
    """The least a decode step can take here: its FLOPs (the experts a token uses) over this
    process's float32 matmul peak, or the weights it reads (every expert once a batch routes
    to all of them) over the read bandwidth, whichever is longer."""
    from meshserve.configs.model_info import read_model_info
    from meshserve.engine.perf import ModelCost
    from meshserve.engine.serving.metrics import measure_roofline

    torch.set_num_threads(cores)
    info = read_model_info(str(args.model_path))
    roof = measure_roofline(torch.float32, "cpu", 1)
    cost = ModelCost(info, 4)
    out: dict = {"peak_flops": roof.peak_flops, "bandwidth": roof.memory_bandwidth}
    for batch in args.batch_sizes:
        context = args.prompt_len + args.output_len // 2
        flops = batch * cost.flops(1, context)
        touched = min(info.moe.num_experts, batch * info.moe.num_experts_per_tok)
        experts = info.num_hidden_layers * info.moe.num_experts_per_tok * info.moe.expert_parameters(info.hidden_size)
        weights = cost.weight_bytes + 4 * experts * (touched / info.moe.num_experts_per_tok - 1)
        nbytes = weights + batch * context * cost.kv_bytes_per_token
        compute, memory = flops / roof.peak_flops, nbytes / roof.memory_bandwidth
        out[batch] = {"flops_per_step": flops, "bytes_per_step": nbytes, "floor_ms": 1000 * max(compute, memory),
                      "bound": "compute" if compute > memory else "memory"}
    return out


def run_meshserve(args, ep: int, threads: int, exchange: str = "all_to_all") -> list[dict]:
    extra = ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
             "--batch-sizes", *map(str, args.batch_sizes)]
    return run_configuration(HERE / "bench_moe.py", overrides(args, ep, threads, exchange), extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", default=str(REPO / "results" / "bench_moe.json"))
    add_rank_args(ap)
    args = ap.parse_args()
    enter_rank_if_asked(HERE / "bench_moe.py", args, BenchMode)

    args.model_path = make_moe_checkpoint(REPO / "results" / "bench-moe-model")
    cores = len(os.sched_getaffinity(0))
    floors = roofline_floors(args, cores)
    arms = {"transformers": lambda: run_transformers(args, cores),
            "ep1": lambda: run_meshserve(args, 1, cores),
            "ep2": lambda: run_meshserve(args, 2, max(1, cores // 2)),
            "ep2_all_reduce": lambda: run_meshserve(args, 2, max(1, cores // 2), "all_reduce")}
    runs: dict[str, list[list[dict]]] = {name: [] for name in arms}
    for r in range(args.rounds):
        names = list(arms)
        for name in names[r % len(names):] + names[:r % len(names)]:
            print(f"# round {r + 1}: {name}", file=sys.stderr, flush=True)
            runs[name].append(arms[name]())

    def median(name: str, i: int, key: str) -> float:
        return statistics.median(run[i][key] for run in runs[name])

    rows = []
    print(f"\nrandom Qwen3-MoE (8 experts, top-2, hidden 512, 8 layers), float32, {cpu_features().describe()}, "
          f"{cores} cores; medians of {args.rounds} rounds")
    for i, batch in enumerate(args.batch_sizes):
        ratios = [m[i]["tok_s"] / t[i]["tok_s"] for m, t in zip(runs["ep1"], runs["transformers"])]
        ep_ratios = [e2[i]["tok_s"] / e1[i]["tok_s"] for e2, e1 in zip(runs["ep2"], runs["ep1"])]
        ar_ratios = [e2[i]["tok_s"] / e1[i]["tok_s"] for e2, e1 in zip(runs["ep2_all_reduce"], runs["ep1"])]
        row = {"batch": batch, **{f"{n}_step_ms": median(n, i, "step_ms") for n in arms},
               **{f"{n}_tok_s": median(n, i, "tok_s") for n in arms},
               "ep2_exchange_ms_per_step": median("ep2", i, "ep_exchange_ms_per_step"),
               "ep2_all_reduce_exchange_ms_per_step": median("ep2_all_reduce", i, "ep_exchange_ms_per_step"),
               "ep2_all_reduce_vs_ep1": statistics.median(ar_ratios), "ep2_all_reduce_vs_ep1_rounds": ar_ratios,
               "vs_transformers": statistics.median(ratios), "vs_transformers_rounds": ratios,
               "ep2_vs_ep1": statistics.median(ep_ratios), "ep2_vs_ep1_rounds": ep_ratios}
        row |= floors[batch]
        rows.append(row)
        print(f"batch {batch:3d}: roofline floor {row['floor_ms']:.1f} ms/step ({row['bound']}-bound: "
              f"{row['flops_per_step'] / 1e9:.2f} GFLOP at {floors['peak_flops'] / 1e9:.0f} GFLOP/s, "
              f"{row['bytes_per_step'] / 1e6:.0f} MB at {floors['bandwidth'] / 1e9:.1f} GB/s)")
        print(f"            transformers {row['transformers_step_ms']:7.1f} ms/step {row['transformers_tok_s']:7.1f} "
              f"tok/s | meshserve ep=1 {row['ep1_step_ms']:7.1f} ms {row['ep1_tok_s']:7.1f} tok/s "
              f"({row['vs_transformers']:.2f}x, rounds {', '.join(f'{x:.2f}' for x in ratios)})")
        print(f"           ep=2 x 1 thread, all-to-all {row['ep2_step_ms']:7.1f} ms {row['ep2_tok_s']:7.1f} tok/s "
              f"({row['ep2_vs_ep1']:.2f}x ep=1), of which expert exchange {row['ep2_exchange_ms_per_step']:.1f} ms/step")
        print(f"           ep=2 x 1 thread, all-reduce {row['ep2_all_reduce_step_ms']:7.1f} ms "
              f"{row['ep2_all_reduce_tok_s']:7.1f} tok/s ({row['ep2_all_reduce_vs_ep1']:.2f}x ep=1), of which expert "
              f"exchange {row['ep2_all_reduce_exchange_ms_per_step']:.1f} ms/step")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_features().describe(), "cores": cores, "args": {
        k: str(v) for k, v in vars(args).items() if k not in ("rank_of", "as_rank", "result")}, "rows": rows,
        "runs": runs}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
