"""Context parallelism on CPU: prefill of one long prompt at cp=1 and cp=2 on the same
cores. Prints wall time, each rank's peak memory for the prefill (activations, measured
as peak resident memory above what the rank held once loaded, plus the KV of the prompt
it stores), and the fraction of ring communication hidden behind compute (1 - the wait
for K/V blocks / the time the same transfers take alone, measured by a probe). Writes JSON.

Prompts: 8,000 tokens on SmolLM2-135M (its context is 8,192) and 32,000 tokens on a
smaller random Llama with a long context (made once under results/).

    python scripts/bench_cp.py [--repeats 2] [--output FILE.json]
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

from bench_common import DriverMode, add_batch, random_prompts, add_rank_args, enter_rank_if_asked, run_configuration

HERE = Path(__file__).resolve().parent


def make_long_checkpoint(directory: Path) -> Path:
    if (directory / "config.json").is_file():
        return directory
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from meshserve.configs.model_info import resolve_model_path

    gguf = resolve_model_path("builtin:smollm2-135m-instruct")
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=40000, rope_theta=1e6,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(directory))
    return directory


def overrides(model: str, prompt_len: int, cp: int, threads: int) -> list[str]:
    return [f"model.path={model}", "model.dtype=float32", f"model.max_model_len={prompt_len + 8}",
            f"parallel.context={cp}", f"device.threads={threads}", "scheduler.max_num_seqs=1",
            f"scheduler.max_batched_tokens={prompt_len}", "cache.memory=768MiB"]


class PrefillMode(DriverMode):
    """Prefill one prompt (one step), `repeats` times; report time, memory and ring waits."""

    def measure(self, engine):
        a = self.args
        runs = []
        for i in range(a.repeats):
            add_batch(engine, random_prompts(1, a.prompt_len, seed=i), 1)
            before = engine.executor.rank_stats()
            start = time.perf_counter()
            while engine.has_work():
                engine.step()
            elapsed = time.perf_counter() - start
            time.sleep(0.5)  # the other ranks' counters for this step arrive
            after = engine.executor.rank_stats()
            runs.append({"seconds": elapsed,
                         "peak_above_ready_mib": {r: (s.peak_rss_bytes - s.ready_rss_bytes) / 2**20 for r, s in after.items()},
                         "ring_wait_s": {r: after[r].cp_wait_seconds - before[r].cp_wait_seconds
                                         for r in after if r in before},
                         "ring_exposed_s": {r: after[r].cp_exposed_seconds - before[r].cp_exposed_seconds
                                            for r in after if r in before}})
        info = engine.executor.runner.info
        kv_per_token = 2 * info.num_hidden_layers * info.num_key_value_heads * info.head_dim * 4
        return {"runs": runs, "kv_per_token": kv_per_token, "layers": info.num_hidden_layers,
                "kv_heads": info.num_key_value_heads, "head_dim": info.head_dim}


def probe_ring(args) -> int:
    """Every rank: the K/V block exchanges of one ring-attention prefill, without compute."""
    import torch.distributed as dist

    from meshserve.launcher.env import rank_env_from_environ
    from meshserve.parallel.process_groups import destroy_process_groups, init_process_groups
    from meshserve.parallel.topology import Topology

    env = rank_env_from_environ()
    torch.set_num_threads(1)
    groups = init_process_groups(Topology(cp_size=env.world_size), env.global_rank, env.master_addr, env.master_port)
    cp = groups.cp
    share = args.prompt_len // cp.size
    block = [torch.randn(share, args.kv_heads, args.head_dim) for _ in range(2)] + [torch.arange(share)]
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        for _layer in range(args.layers):
            for _step in range(cp.size - 1):
                incoming = [torch.empty_like(t) for t in block]
                ops = [dist.P2POp(dist.isend, t, cp.next_rank, cp.device_group) for t in block]
                ops += [dist.P2POp(dist.irecv, t, cp.prev_rank, cp.device_group) for t in incoming]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        times.append(time.perf_counter() - start)
    if env.global_rank == 0:
        Path(args.result).write_text(json.dumps({"seconds": statistics.median(times)}))
    destroy_process_groups()
    return 0


def run_probe(args, stats: dict) -> float:
    from meshserve.configs import load_config
    from meshserve.launcher.spawn import spawn_local_ranks
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        cmd = [str(HERE / "bench_cp.py"), "--probe", "--as-rank", "--result", result.name,
               "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats), "--layers", str(stats["layers"]),
               "--kv-heads", str(stats["kv_heads"]), "--head-dim", str(stats["head_dim"])]
        spawn_local_ranks(load_config(None, ["parallel.context=2", "device.threads=1"]), cmd, shutdown_timeout=30)
        return json.loads(Path(result.name).read_text())["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output", default="results/bench_cp.json")
    ap.add_argument("--cases", nargs="+", default=["smollm2:8000", "long:32000"])
    add_rank_args(ap)
    ap.add_argument("--prompt-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--kv-heads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--head-dim", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        sys.exit(probe_ring(args))
    enter_rank_if_asked(HERE / "bench_cp.py", args, PrefillMode)

    cores = len(os.sched_getaffinity(0))
    report = []
    for case in args.cases:
        name, length = case.split(":")
        args.prompt_len = int(length)
        model = "builtin:smollm2-135m-instruct" if name == "smollm2" else str(make_long_checkpoint(
            Path("results") / "bench-cp-model"))
        row = {"model": name, "prompt_len": args.prompt_len}
        for cp in (1, 2):
            extra = ["--repeats", str(args.repeats), "--prompt-len", str(args.prompt_len)]
            out = run_configuration(HERE / "bench_cp.py", overrides(model, args.prompt_len, cp, max(1, cores // cp)),
                                    extra)
            runs = out["runs"]
            kv_mib = args.prompt_len / cp * out["kv_per_token"] / 2**20
            peak = max(statistics.median(r["peak_above_ready_mib"][k] for r in runs) for k in runs[0]["peak_above_ready_mib"])
            row[f"cp{cp}"] = {"seconds": statistics.median(r["seconds"] for r in runs),
                              "activations_peak_mib": peak, "kv_mib": kv_mib, "per_rank_mib": peak + kv_mib,
                              "ring_wait_s": statistics.median(max(r["ring_wait_s"].values(), default=0.0) for r in runs),
                              "ring_exposed_s": statistics.median(max(r["ring_exposed_s"].values(), default=0.0)
                                                                  for r in runs)}
            if cp == 2:
                comm = run_probe(args, out)
                row["cp2"]["ring_transfer_alone_s"] = comm
                row["cp2"]["hidden_fraction"] = max(0.0, 1 - row["cp2"]["ring_exposed_s"] / comm) if comm else None
        one, two = row["cp1"], row["cp2"]
        row["time_ratio"] = two["seconds"] / one["seconds"]
        row["memory_ratio"] = two["per_rank_mib"] / one["per_rank_mib"]
        print(f"{name} {args.prompt_len} tokens: cp=1 {one['seconds']:.1f} s, {one['per_rank_mib']:.0f} MiB | "
              f"cp=2 {two['seconds']:.1f} s ({row['time_ratio']:.2f}x), {two['per_rank_mib']:.0f} MiB per rank "
              f"({row['memory_ratio']:.2f}x) | ring transfers {two['ring_transfer_alone_s']:.2f} s alone, "
              f"{two['ring_exposed_s']:.2f} s exposed ({two['hidden_fraction']:.0%} hidden); waits for the peer "
              f"{two['ring_wait_s']:.2f} s", flush=True)
        report.append(row)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"cores": cores, "repeats": args.repeats, "cases": report}, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
