"""A rank's world breaking: the first report wins, the reactions run once, on a thread of
their own.

Whoever notices first calls `trigger(reason)`: the heartbeat monitor (a peer went silent,
or the driver aborted), the step loop (a collective raised), or a shared-memory collective
spinning on a peer that will never arrive (it polls `is_set`). The reactions (the driver:
fail every in-flight request, tell the other ranks, exit non-zero; the other ranks: exit)
run on a new thread, so the caller, which may be the heartbeat thread or a thread stuck in
a collective, is never what they wait on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """Raised where a rank notices its world is broken (a collective cannot complete)."""


class FailureSignal:
    def __init__(self):
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._reactions: list[Callable[[str], None]] = []
        self.reason: str | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def on_failure(self, reaction: Callable[[str], None]) -> None:
        """Run `reaction(reason)` once the world breaks (at once if it already has)."""
        with self._lock:
            self._reactions.append(reaction)
            fired = self.reason
        if fired is not None:
            self._spawn(reaction, fired)

    def trigger(self, reason: str) -> bool:
        """Report a failure; returns whether this was the first report."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason = reason
            self._event.set()
            reactions = list(self._reactions)
        log.error("%s", reason)
        for reaction in reactions:
            self._spawn(reaction, reason)
        return True

    def check(self) -> None:
        """Raise RankFailure if the world is broken."""
        if self._event.is_set():
            raise RankFailure(self.reason)

    @staticmethod
    def _spawn(reaction: Callable[[str], None], reason: str) -> None:
        threading.Thread(target=reaction, args=(reason,), name="meshserve-failure", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)
