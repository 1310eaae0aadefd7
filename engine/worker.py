"""The loop of every rank but the driver: receive a plan, run it, report tokens."""

from __future__ import annotations

import logging
import time

from meshserve.comm.control import WorkerChannel
from meshserve.comm.messages import Shutdown
from meshserve.engine.model_runner import ModelRunner
from meshserve.engine.pending_result import resolved

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.2


def worker_loop(runner: ModelRunner, channel: WorkerChannel) -> None:
    """Runs until the driver publishes Shutdown; reports its counters after its first step,
    then every STATS_INTERVAL_S (a deployment that served only a short burst still shows
    every rank)."""
    started = time.monotonic()
    last_report = started - STATS_INTERVAL_S
    steps = 0
    while True:
        msg = channel.recv()
        if isinstance(msg, Shutdown):
            log.info("rank %d: shutdown (%s)", channel.rank, msg.reason or "driver finished")
            return
        result = resolved(runner.execute(msg))
        steps += 1
        if result is not None:
            channel.send_result(result)
        now = time.monotonic()
        if now - last_report >= STATS_INTERVAL_S:
            channel.send_stats(runner.rank_stats(now - started, steps))
            last_report = now
