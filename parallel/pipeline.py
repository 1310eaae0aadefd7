"""The pipeline schedule: micro-batches in flight on the driver, bounded sends between stages.

With pp stages, one step at a time would leave all but one stage idle. The driver keeps
up to `count` steps (micro-batches) in flight instead: it submits a step, and while the
first stage works on it, schedules the next; it waits only for the oldest step's tokens,
so steps finish in submission order. Two rules make this correct and fair:

- no sequence is in two in-flight steps: its next token is not known until the step
  that computes its last one finishes (`MicroBatches.busy`);
- each free slot takes an even share of the sequences that can run (`MicroBatches.share`),
  so one step does not take everything and leave the other slots empty.

Between stages, a stage sends its activations to the next without waiting for them to
arrive (`StageSender`), so it can start on the next micro-batch at once. The number of
sends in flight is bounded: each holds a tensor alive until received, and a stage that
runs ahead of the next one would otherwise pile up memory without end.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Generic, Iterable, TypeVar

import torch

from meshserve.comm.collectives import send_to_next_stage
from meshserve.comm.groups import AxisGroup

Step = TypeVar("Step")

MAX_PENDING_SENDS = 4
"""Activations sent to the next stage and not yet known to be received."""


class MicroBatches(Generic[Step]):
    """The driver's steps in flight, oldest first. A step is whatever the caller keeps for
    it (its batch and the executor's handle), pushed with the ids of its sequences."""

    def __init__(self, count: int, overlapping: bool = False):
        """`count`: steps kept in flight at once (1: no pipelining). `overlapping`: the
        steps are one stage's, each submitted while the one before runs, and may share
        sequences (engine/engine.py, overlapped steps); no step takes a share."""
        if count < 1:
            raise ValueError(f"micro_batches={count}: at least 1 step must be in flight")
        self.count = count
        self.overlapping = overlapping
        self._steps: deque[tuple[Step, frozenset[int]]] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def full(self) -> bool:
        return len(self._steps) >= self.count

    def busy(self) -> frozenset[int]:
        """Sequences in a step in flight: none of them may be scheduled again until it finishes."""
        return frozenset().union(*(ids for _, ids in self._steps))

    def share(self, ready: int) -> int | None:
        """The most sequences the next step may take: an even share of the `ready` ones
        (not busy) over the free slots, at least 1; None (no limit) without pipelining."""
        if self.count == 1 or self.overlapping:
            return None
        if self.full():
            raise ValueError(f"all {self.count} micro-batches are in flight: no slot to share")
        return max(1, math.ceil(ready / (self.count - len(self._steps))))

    def push(self, step: Step, seq_ids: Iterable[int]) -> None:
        """Put `step`, over the sequences `seq_ids`, in flight (after the others)."""
        ids = frozenset(seq_ids)
        if self.full():
            raise ValueError(f"all {self.count} micro-batches are already in flight")
        if ids & self.busy() and not self.overlapping:
            raise ValueError(f"seqs {sorted(ids & self.busy())} are already in a step in flight")
        self._steps.append((step, ids))

    def pop(self) -> Step:
        """The oldest step in flight, which is no longer."""
        return self._steps.popleft()[0]


class StageSender:
    """Sends activations to the next pipeline stage, waiting only once more than
    `max_pending` sends are unconfirmed (the oldest first)."""

    def __init__(self, group: AxisGroup, max_pending: int = MAX_PENDING_SENDS):
        self.group, self.max_pending = group, max_pending
        self._pending: deque[tuple[torch.Tensor, list]] = deque()
        """(tensor, its works): the tensor must stay alive until its send completes."""

    def send(self, x: torch.Tensor) -> None:
        """Sends `x` to the next stage of `group` (batched isend)."""
        self._pending.append((x, send_to_next_stage(x, self.group)))
        while len(self._pending) > self.max_pending:
            _, works = self._pending.popleft()
            for work in works:
                work.wait()
