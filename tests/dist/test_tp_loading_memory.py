"""Each rank reads only its shard: peak memory while loading SmolLM2 at tp = 3 stays
near a third of the single-rank load, not the whole model."""

from __future__ import annotations

import resource

import pytest
import torch

from meshserve.comm.groups import AxisGroup
from meshserve.configs.model_info import read_model_info
from meshserve.layers.gguf_index import gguf_tensors
from meshserve.layers.loader import build_model
from meshserve.parallel.topology import Topology
from support.checkpoints import smollm2_path
from support.dist import run_ranks


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def load_and_measure(groups, path) -> int:
    """Peak resident-memory growth (bytes) of loading this rank's shard."""
    info = read_model_info(str(path))
    gguf_tensors(info.path)  # maps the GGUF and reads its tensor index (not part of the weights)
    # NOTE: reset the peak first: a forked rank inherits the test process's (ru_maxrss too).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_bytes()
    model = build_model(info, groups.tp if groups else AxisGroup.single("tp"), torch.float32, max_position=512)
    peak = _peak_rss_bytes()
    del model
    return peak - before


@pytest.mark.slow
def test_peak_loading_memory_per_rank_is_about_a_third_at_tp3():
    path = smollm2_path()
    single = run_ranks(load_and_measure, Topology(), path)[0]
    per_rank = run_ranks(load_and_measure, Topology(tp_size=3), path)
    weights = 134_515_008 * 4
    print(f"peak load growth: tp=1 {single / 2**20:.0f} MiB; tp=3 ranks " + ", ".join(f"{g / 2**20:.0f} MiB" for g in per_rank))
    assert single > 0.9 * weights  # the whole fp32 model
    for grown in per_rank:
        assert grown < 0.5 * single, f"a tp=3 rank grew {grown / 2**20:.0f} MiB vs {single / 2**20:.0f} MiB at tp=1"
