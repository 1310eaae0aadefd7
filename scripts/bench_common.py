"""Shared by the multi-rank benchmarks: run one configuration through meshserve's own
launcher (each rank re-runs the calling script with --as-rank) and hand the driver's
measurements back as JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config


def random_prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    return torch.randint(1000, 40000, (batch, length), generator=torch.Generator().manual_seed(seed)).tolist()


def add_batch(engine, prompts: list[list[int]], output_len: int) -> None:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(i, str(i), p, params)


def run_configuration(script: Path, overrides: list[str], extra_args: list[str]) -> object:
    """Run `script --rank-of ...` (which calls `rank_entry`) in a fresh process; returns
    what the driver's mode wrote."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        cmd = [sys.executable, str(script), "--rank-of", json.dumps(overrides), "--result", result.name, *extra_args]
        subprocess.run(cmd, check=True)
        return json.loads(Path(result.name).read_text())


def add_rank_args(ap) -> None:
    """The internal flags of one configuration's run (run_configuration passes them)."""
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)
    ap.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)


def enter_rank_if_asked(script: Path, args, mode_cls) -> None:
    """Called as one configuration's run (--rank-of): run it (or be one of its ranks) and exit."""
    if args.rank_of:
        sys.exit(rank_entry(script, sys.argv[1:], json.loads(args.rank_of), args.as_rank, mode_cls(args)))


def rank_entry(script: Path, argv: list[str], overrides: list[str], as_rank: bool, mode) -> int:
    """Without as_rank: start the configuration's ranks through meshserve's launcher;
    with it: be one of those ranks (the driver runs `mode`)."""
    from meshserve.launcher.env import rank_env_from_environ
    from meshserve.launcher.rank import run_rank
    from meshserve.launcher.spawn import spawn_local_ranks

    config = load_config(None, overrides)
    info = check_config(config)
    if not as_rank:
        return spawn_local_ranks(config, [str(script), *argv, "--as-rank"], shutdown_timeout=30)
    return run_rank(config, info, plan_memory(config, info), rank_env_from_environ(), mode)


class DriverMode:
    """Base for a benchmark's driver: no preparation; `measure(engine)` returns the JSON."""

    def __init__(self, args):
        self.args = args

    def prepare(self, config, tokenizer, info, memory) -> None:
        pass

    def run(self, engine) -> int:
        Path(self.args.result).write_text(json.dumps(self.measure(engine)))
        return 0

    def measure(self, engine):
        raise NotImplementedError
