"""All-reduce and gather through shared memory, for the CPU ranks of one node.

gloo moves every all-reduce through loopback TCP and its own threads, which costs
milliseconds per call on a small CPU, and a decode step makes two calls per layer. Ranks
on one node can instead write their tensor to a shared segment, wait for the others, and
read every slot: one barrier per call, microseconds when the ranks have a core each.

Layout of the segment: two buffer sets (double buffering: a rank may start call k+1 while
another still reads call k's set; it cannot reach call k+2 before everyone posted k+1,
which they do only after reading k), each with one slot per rank, then one int64 flag
per rank holding the number of the last call it posted.

NOTE: ordering relies on x86's total store order (data written before the flag is
visible before it). Every rank sums the slots in the same order, so every rank gets the
same bits.
"""

from __future__ import annotations

import math
import mmap
import os
import time
import uuid
from pathlib import Path

import torch

from meshserve.comm.failure import FailureSignal, RankFailure
from meshserve.comm.groups import AxisGroup

SPINS_BEFORE_YIELD = 64


class ShmCommunicator:
    def __init__(self, group: AxisGroup, slot_bytes: int, timeout_s: float, name: str):
        """`name`: the segment's file under /dev/shm, the same on every member (made by member 0)."""
        self.size, self.rank = group.size, group.rank
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._calls = 0
        data_bytes = 2 * self.size * slot_bytes
        total = data_bytes + 8 * self.size
        path = Path("/dev/shm") / name
        if self.rank == 0:
            # NOTE: mode 0600, and never an existing file or a link: the activations of every
            # step pass through the segment, which other users of the machine must not read.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, total)
            finally:
                os.close(fd)
        self._wait_for(path)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), total)
        buf = torch.frombuffer(self._map, dtype=torch.uint8)
        self._slots = buf[:data_bytes].view(2, self.size, slot_bytes)
        self._flags = buf[data_bytes:].view(torch.int64)
        self._flags_np = self._flags.numpy()
        self.failure: FailureSignal | None = None
        """Set by the rank once its failure signal exists: a collective waiting on a peer
        stops with RankFailure as soon as the world is known to be broken."""

    def attached(self, path_name: str) -> None:
        """Once every member has mapped the segment: remove its name, so nothing leaks
        even if a rank is killed (the memory lives until the last mapping goes)."""
        if self.rank == 0:
            (Path("/dev/shm") / path_name).unlink(missing_ok=True)

    @staticmethod
    def _wait_for(path: Path, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not (path.exists() and path.stat().st_size > 0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"shared-memory segment {path} did not appear within {timeout:.0f} s")
            time.sleep(0.001)

    def fits(self, x: torch.Tensor, rows: int | None = None) -> bool:
        """Whether `x` (or `rows` rows shaped as x's) fits a slot."""
        nbytes = x.numel() * x.element_size() if rows is None else rows * _row_bytes(x)
        return nbytes <= self.slot_bytes and x.device.type == "cpu"

    def _post(self, x: torch.Tensor, nbytes: int | None = None) -> torch.Tensor:
        """Write x to this rank's slot of the current set and wait until every rank has
        posted the same call; returns the set's first `nbytes` (default x's) of each slot,
        (size, nbytes) uint8."""
        self._calls += 1
        call = self._calls
        written = x.numel() * x.element_size()
        slots = self._slots[call % 2, :, :nbytes or written]
        slots[self.rank, :written].view(x.dtype).view(x.shape).copy_(x)
        self._flags_np[self.rank] = call
        flags = self._flags_np
        spins = 0
        deadline = None
        while flags.min() < call:
            spins += 1
            if spins % SPINS_BEFORE_YIELD == 0:
                os.sched_yield()
                if self.failure is not None and self.failure.is_set():
                    raise RankFailure(f"shared-memory collective #{call} abandoned: {self.failure.reason}")
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    late = [r for r in range(self.size) if flags[r] < call]
                    raise TimeoutError(f"shared-memory collective #{call}: ranks {late} of the group did not "
                                       f"arrive within {self.timeout_s:.0f} s")
        return slots

    def _parts(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's x (posted now), (size, *x.shape)."""
        return self._post(x).view(x.dtype).view(self.size, *x.shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the group, in place."""
        torch.sum(self._parts(x), dim=0, out=x)
        return x

    def gather(self, x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """Every member's x, concatenated along the last dim, on member `dst`."""
        parts = self._parts(x)
        if self.rank != dst:
            return None
        return torch.cat(list(parts.unbind(0)), dim=-1)

    def reduce_scatter_rows(self, x: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of the sum of x over the group (every member's x has
        the same shape): a new tensor."""
        parts = self._parts(x)[:, start:start + count]
        out = parts[0].clone()
        for part in parts[1:]:  # summed in place: a sum over dim 0 of the strided rows would copy them all
            out += part
        return out

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every member's rows (member i's x has counts[i] rows), member 0's first: a new tensor."""
        row_bytes = _row_bytes(x)
        slots = self._post(x, max(counts) * row_bytes)
        out = x.new_empty((sum(counts), *x.shape[1:]))
        start = 0
        for member, n in enumerate(counts):
            out[start:start + n] = slots[member, :n * row_bytes].view(x.dtype).view(n, *x.shape[1:])
            start += n
        return out

    def close(self) -> None:
        self._slots = self._flags = self._flags_np = None
        self._map.close()


def _row_bytes(x: torch.Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def new_segment_name() -> str:
    return f"meshserve-{os.getpid()}-{uuid.uuid4().hex[:12]}"
