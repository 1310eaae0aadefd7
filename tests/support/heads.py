"""Draft heads (sequential, or Medusa's) self-distilled for a tiny checkpoint in a few seconds, with the functions of
scripts/train_heads.py: on its own greedy answers to `prompts` (token ids)."""

from __future__ import annotations

from pathlib import Path

import torch

from meshserve.comm.messages import SamplingParams
from support.engines import make_engine
from support.scripts import script_module


def self_distilled_heads(path: Path, prompts: list[list[int]], out: Path, num_heads: int = 3,
                         max_tokens: int = 64, epochs: int = 12, sequential: bool = True) -> Path:
    torch.manual_seed(0)
    with script_module("train_heads") as train:
        engine = make_engine(path)
        convs, hidden = train.answered(engine, prompts,
                                       SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        info = engine.executor.runner.model.info
        x, y = train.examples(hidden, convs, num_heads)
        heads = train.new_heads(info, convs, num_heads, 1, vocab_size=4096, sequential=sequential)
        train.train(heads, x, y, epochs, batch=64, lr=1e-2)
    heads.save(out)
    return out
