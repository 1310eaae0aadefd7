"""Draft heads (sequential, or Medusa's) self-distilled for a tiny checkpoint in a few seconds, with the functions of
scripts/train_heads.py: on its own greedy answers to `prompts` (token ids)."""

from __future__ import annotations

from pathlib import Path

import torch

from meshserve.comm.groups import AxisGroup
from meshserve.comm.messages import SamplingParams
from meshserve.engine.offline import generate
from meshserve.layers.loader import build_model
from support.engines import make_engine
from support.scripts import script_module


def self_distilled_heads(path: Path, prompts: list[list[int]], out: Path, num_heads: int = 3,
                         max_tokens: int = 64, epochs: int = 12, sequential: bool = True) -> Path:
    torch.manual_seed(0)
    with script_module("train_heads") as train:
        engine = make_engine(path)
        answers = generate(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        convs = [(p, a.token_ids) for p, a in zip(prompts, answers)]
        info = engine.executor.runner.model.info
        model = build_model(info, AxisGroup.single("tp"), torch.float32, max_position=256)
        x, y = train.examples(train.final_hidden(model, convs, info.hidden_size), convs, num_heads)
        heads = train.new_heads(info, convs, num_heads, 1, vocab_size=4096, sequential=sequential)
        train.train(heads, x, y, epochs, batch=64, lr=1e-2)
    heads.save(out)
    return out
