"""A single-rank engine for a checkpoint and config overrides, as the engine-level tests
build it."""

from __future__ import annotations

import torch

from meshserve.configs import load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine.build import build_single_rank_engine
from support.server import EXACT


def make_engine(path, *overrides):
    """The engine for `path` with model.max_model_len=256, float32 (EXACT) and `overrides`
    (KEY=VALUE, which may override both). With
    device.compile=true (or auto), torch.compile's caches are reset first: each engine's model is a
    new module whose graphs take a new cache entry, and past dynamo's per-function limit
    (8) steps would run eagerly without a word, however many tests built engines before."""
    compiles = "device.compile=true" in overrides or "device.compile=auto" in overrides
    if compiles:
        torch._dynamo.reset()
    if compiles and not any(o.startswith("device.compile_wait=") for o in overrides):
        overrides = (*overrides, "device.compile_wait=true")  # the tests check the graphs from the first step
    config = load_config(None, [EXACT, f"model.path={path}", "model.max_model_len=256", *overrides])
    info = check_config(config)
    return build_single_rank_engine(config, info, plan_memory(config, info), threads=None)
