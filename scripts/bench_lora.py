"""The cost of LoRA adapters in a decode step: a batch of --batch sequences decoding together,
SmolLM2 on one CPU rank (the default dtype of this CPU), in three variants:

- `base`: no adapters served (the server's default step: the fused C++ decode layers where
  this CPU takes them);
- `lora-off-rows`: adapters served (lora.enabled), every row without one;
- `lora`: every row with one of --adapters adapters of rank --rank on all seven projections,
  spread evenly (the grouped shrink-expand product per layer, layers/lora.py).

Each variant is its own engine, in this process, run in turn each round, so the ratios are
taken against the same round's `base`; the table shows the medians over --rounds of the
median decode step (steps computing one token per sequence, all --batch of them). Prompts
are new in each run. The adapters are random PEFT-format files written to a temporary
directory (their weights do not change the cost).

    python scripts/bench_lora.py [--batch 32] [--adapters 8] [--rank 16] [--rounds 3] [--output out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.adapters import TARGETS, module_shape
from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine.build import build_single_rank_engine

VARIANTS = ("base", "lora-off-rows", "lora")


def write_adapters(info, root: Path, count: int, rank: int, base: Path | None = None) -> dict[str, str]:
    """`count` random adapters of `rank` on every target of every layer, name -> directory, in
    PEFT's format (what vLLM reads too); `base`: the base model's directory they name."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(count):
        d = root / f"bench{i}"
        d.mkdir(parents=True)
        tensors = {}
        for layer in range(info.num_hidden_layers):
            for module in TARGETS:
                rows, cols = module_shape(info, module)
                block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, cols, generator=g) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.02
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
            "target_modules": list(TARGETS), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
            "use_rslora": False, "use_dora": False, "base_model_name_or_path": str(base) if base else None}))
        out[f"bench{i}"] = str(d)
    return out


class StepTimes:
    """EngineObserver: each step's seconds, kept for steps that decode the whole batch."""

    def __init__(self, batch: int):
        self.batch, self.seconds = batch, []

    def on_step(self, batch, context_lens, seconds):
        if len(batch.seqs) == self.batch and batch.num_tokens == self.batch:
            self.seconds.append(seconds)

    def __getattr__(self, name):  # the observer's other hooks: nothing to do
        return lambda *args, **kwargs: None


def run_variant(variant: str, adapters: dict[str, str], args, seed: int) -> float:
    """The median decode step (seconds) of one fresh engine."""
    sets = [f"model.max_model_len={args.prompt_len + args.output_len + 16}", f"scheduler.max_num_seqs={args.batch}",
            "cache.prefix_caching=false"]
    if variant != "base":
        table = ", ".join(f"{n}: {p}" for n, p in adapters.items())
        sets += ["lora.enabled=true", f"lora.adapters={{{table}}}", f"lora.max_loras={len(adapters)}",
                 f"lora.max_rank={args.rank}"]
    config = load_config(None, sets)
    info = check_config(config)
    engine = build_single_rank_engine(config, info, plan_memory(config, info), threads=args.threads)
    times = StepTimes(args.batch)
    engine.observer = times
    rng = random.Random(seed)
    names = list(adapters)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randrange(1000, info.vocab_size) for _ in range(args.prompt_len)]
        engine.add_request(i, str(i), prompt, params, lora=names[i % len(names)] if variant == "lora" else None)
    while engine.has_work():
        engine.step()
    engine.shutdown()
    return statistics.median(times.seconds[2:])  # the first steps warm the caches


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    cpu = cpu_features()
    print(f"# CPU: {cpu.describe()}; torch threads {args.threads or torch.get_num_threads()}", file=sys.stderr)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        info = check_config(load_config(None, []))
        adapters = write_adapters(info, Path(tmp), args.adapters, args.rank)
        for r in range(args.rounds):
            step = {v: run_variant(v, adapters, args, seed=1000 * r + i) for i, v in enumerate(VARIANTS)}
            rounds.append(step)
            print(f"# round {r + 1}: " + ", ".join(f"{v} {s * 1e3:.2f} ms ({s / step['base']:.2f}x)"
                                                  for v, s in step.items()), file=sys.stderr)
    summary = {"cpu": cpu.describe(), "batch": args.batch, "adapters": args.adapters, "rank": args.rank,
               "rounds": rounds, "median_ms": {}, "ratio_to_base": {}}
    print(f"\ndecode step at batch {args.batch}, {args.adapters} adapters of rank {args.rank} "
          f"({cpu.describe()}), median of {args.rounds} rounds:")
    print(f"{'variant':<16}{'step ms':>10}{'x base':>10}")
    for v in VARIANTS:
        ms = statistics.median(step[v] for step in rounds) * 1e3
        ratio = statistics.median(step[v] / step["base"] for step in rounds)
        summary["median_ms"][v], summary["ratio_to_base"][v] = ms, ratio
        print(f"{v:<16}{ms:>10.2f}{ratio:>10.2f}")
    if args.output:
        args.output.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
