"""`model.quantization: auto`: the fastest path for this machine, chosen before any rank
starts (no torch here).

The choice is for one of two targets: latency (one stream: `scheduler.max_num_seqs: 1`)
or throughput (every other config). It comes from the record `meshserve advise` left for
this model, CPU and thread count (engine/advisor.py measures the candidates on the machine
at hand), or, without one, from a rule measured on each kind of CPU:

    CUDA                             bfloat16, no quantization
    CPU, bf16 dot products (AMX,     throughput: bfloat16        latency: bfloat16 + int4
        AVX512-BF16)
    CPU without them (AVX2)          throughput: float32         latency: bfloat16 + int4

`model.dtype` takes the chosen dtype while it is `auto`; a dtype set by hand stays, with the
fastest recorded quantization in that dtype (or the rule's quantization).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from meshserve.configs.artifact_cache import CACHE_ROOT, file_key
from meshserve.configs.cpu_bind import rank_cores, thread_share
from meshserve.configs.cpu_features import CpuFeatures, cpu_features, usable_cores
from meshserve.configs.model_info import resolve_model_path
from meshserve.configs.quantization import Quantization
from meshserve.configs.schema import Config

ADVICE_VERSION = "1"
TARGETS = ("latency", "throughput")


@dataclass(frozen=True)
class Candidate:
    """One candidate path: activations' dtype and the linear layers' quantization."""

    dtype: str
    quantization: Quantization

    def __post_init__(self):
        object.__setattr__(self, "quantization", Quantization(self.quantization))  # "int4" given: the member

    @property
    def name(self) -> str:
        return self.dtype if self.quantization is Quantization.NONE else f"{self.dtype}+{self.quantization}"

    def overrides(self) -> list[str]:
        return [f"model.dtype={self.dtype}", f"model.quantization={self.quantization}"]


_Q = Quantization
CANDIDATES = (Candidate("float32", _Q.NONE), Candidate("bfloat16", _Q.NONE), Candidate("float32", _Q.INT4),
              Candidate("bfloat16", _Q.INT4), Candidate("bfloat16", _Q.INT8), Candidate("bfloat16", _Q.W8A8))
"""What `meshserve advise` measures (float32 + int8 is left out: its weight-only kernel
widens every row to float32 and is slower than float32 itself on every CPU measured)."""


def target_of(config: Config) -> str:
    return "latency" if config.scheduler.max_num_seqs == 1 else "throughput"


def threads_per_rank(config: Config, cores: int | None = None) -> int:
    """The intra-op threads each rank of this node runs, as the launcher places them
    (before OMP_NUM_THREADS, which only the launcher reads)."""
    available = list(range(cores)) if cores else usable_cores()
    share = thread_share(rank_cores(config.device.cpu_bind, available, 0, config.ranks_per_node), available,
                         config.ranks_per_node)
    return min(config.device.threads or share, share)


def advice_path(config: Config, cpu: CpuFeatures, threads: int) -> Path:
    """Where `meshserve advise` records its measurement of this model on this CPU at this
    thread count."""
    key = file_key(resolve_model_path(config.model.path), ADVICE_VERSION, cpu.describe(), str(threads))
    return CACHE_ROOT / "advice" / f"{key}.json"


def read_advice(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if all(t in record.get("choice", {}) for t in TARGETS) else None


def rule_choice(device_type: str, cpu: CpuFeatures, target: str) -> Candidate:
    if device_type == "cuda":
        return Candidate("bfloat16", Quantization.NONE)
    if target == "latency":
        return Candidate("bfloat16", Quantization.INT4)
    return Candidate("bfloat16" if cpu.bf16_compute and cpu.known else "float32", Quantization.NONE)


def choose_auto(config: Config, cpu: CpuFeatures | None = None, advice_file: Path | None = None
                ) -> tuple[Candidate, str]:
    """What `model.quantization: auto` (and `model.dtype: auto` beside it) becomes, and a
    line saying what was chosen and why."""
    cpu = cpu or cpu_features()
    target = target_of(config)
    wanted_dtype = config.model.dtype
    choice, why = None, None
    if config.device.type == "cpu":
        advice_file = advice_file or advice_path(config, cpu, threads_per_rank(config))
        record = read_advice(advice_file)
        if record is not None:
            choice, why = _from_record(record, target, wanted_dtype)
    if choice is None:
        choice = rule_choice(config.device.type, cpu, target)
        where = cpu.describe() if config.device.type == "cpu" else config.device.type
        why = f"the rule for {where}; `meshserve advise` measures this machine and records its choice"
    if wanted_dtype != "auto":
        choice = Candidate(wanted_dtype, choice.quantization)
    return choice, (f"model.quantization=auto -> {choice.name} for {target} "
                    f"(scheduler.max_num_seqs={config.scheduler.max_num_seqs}): {why}")


def _from_record(record: dict, target: str, wanted_dtype: str) -> tuple[Candidate | None, str | None]:
    """The record's fastest path for `target` (in `wanted_dtype`, unless auto)."""
    rates = {name: c[target] for name, c in record["candidates"].items() if c.get(target)}
    if wanted_dtype != "auto":
        rates = {n: r for n, r in rates.items() if n.split("+")[0] == wanted_dtype}
    if not rates:
        return None, None
    best = max(rates, key=rates.get)
    dtype, _, quantization = best.partition("+")
    return (Candidate(dtype, Quantization(quantization or "none")),
            f"measured by `meshserve advise` on this machine ({rates[best]:.1f} tok/s estimated, "
            f"{record['threads']} threads)")
