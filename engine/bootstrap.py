"""Assemble an engine from a validated config."""

from __future__ import annotations

import torch

from meshserve.configs.memory import MemoryPlan
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.schema import Config
from meshserve.engine.calibration import calibration_ids
from meshserve.engine.engine import Engine
from meshserve.engine.executor import LocalExecutor
from meshserve.engine.model_runner import ModelRunner
from meshserve.engine.tokenizer import Tokenizer
from meshserve.parallel.topology import Groups


def build_single_rank_engine(config: Config, info: ModelInfo, memory: MemoryPlan, *, threads: int | None = None,
                             show_progress: bool = False) -> Engine:
    if threads:
        torch.set_num_threads(threads)
    tokenizer = Tokenizer(info, config.model.tokenizer)
    runner = ModelRunner(info, memory, Groups.single(), device=config.device.type, show_progress=show_progress,
                         kernels=config.device.kernels, cpu_isa=config.device.cpu_isa, compile_decode=config.device.compile,
                         calibration=calibration_ids(config, info, tokenizer))
    return Engine(LocalExecutor(runner), tokenizer, memory, config.scheduler, info.vocab_size)
