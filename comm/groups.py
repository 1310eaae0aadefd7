"""One parallel axis as seen from one rank. Built once by meshserve.parallel.topology
and passed into every layer and collective that needs it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CommTimer:
    """Wall time spent in this group's collectives (for the per-step time split)."""

    seconds: float = 0.0
    calls: int = 0
    exposed_seconds: float = 0.0
    """Ring transfers: time spent waiting for data after its transfer had begun and the
    compute meant to hide it had ended (waiting for a late peer is not counted)."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, started: float) -> None:
        self.seconds += time.perf_counter() - started
        self.calls += 1


@dataclass(frozen=True)
class AxisGroup:
    """The tp, pp or cp group of this rank."""

    name: str
    size: int
    rank: int
    """This rank's index within the group."""
    ranks: tuple[int, ...]
    """Global ranks of the group, in group order."""
    device_group: Any = None
    """torch.distributed group for tensors on the compute device (NCCL on CUDA, gloo on CPU)."""
    cpu_group: Any = None
    """gloo group for host tensors."""
    timer: CommTimer = field(default_factory=CommTimer, compare=False)
    shm: Any = None
    """A ShmCommunicator when every member is a CPU rank of this node: collectives that fit
    its slots go through shared memory instead of device_group."""

    @classmethod
    def single(cls, name: str, global_rank: int = 0) -> "AxisGroup":
        """A group of one: every collective on it is the identity."""
        return cls(name, 1, 0, (global_rank,))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (ring order)."""
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (ring order)."""
        return self.ranks[(self.rank - 1) % self.size]
