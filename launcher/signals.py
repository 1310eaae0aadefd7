"""SIGTERM and SIGINT in a process that serves clients (a replica's driver, the front door,
another node's replicas): one handler, so every such process stops the same way."""

from __future__ import annotations

import logging
import signal
import sys
import time
from typing import Callable

log = logging.getLogger("meshserve")

SAME_SIGNAL_S = 1.0
"""A signal this soon after the first is the same stop request arriving by another path
(Ctrl-C reaches every process of the terminal's group, and the launcher forwards it)."""
EXIT_AT_ONCE = 1


def on_stop_signals(draining: str, drain_timeout: float, drain: Callable[[], None],
                    end_now: Callable[[], None]) -> None:
    """Handle SIGTERM and SIGINT from now on: the first calls `drain()` (new requests are
    refused, those in flight finish, up to `drain_timeout`); a second calls `end_now()` (the
    requests in flight end now); a third exits at once (status EXIT_AT_ONCE). A signal within
    SAME_SIGNAL_S of the first counts as the first. `draining` says what the first does, for
    the log ("draining 2 replicas")."""
    first: list[float] = []
    ended_now: list[bool] = []

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if not first:
            first.append(time.monotonic())
            log.info("%s: %s (up to %.0f s; a second signal ends the requests now)", name, draining, drain_timeout)
            drain()
        elif time.monotonic() - first[0] < SAME_SIGNAL_S:
            pass  # one Ctrl-C reaching us twice: from the terminal and forwarded by the launcher
        elif not ended_now:
            ended_now.append(True)
            log.warning("second %s: ending the requests in flight now", name)
            end_now()
        else:
            log.warning("third %s: exiting at once", name)
            sys.exit(EXIT_AT_ONCE)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
