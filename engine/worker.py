"""The loop of every rank but the driver: receive a plan, run it, report tokens."""

from __future__ import annotations

import logging

from meshserve.comm.control import WorkerChannel
from meshserve.comm.messages import Shutdown
from meshserve.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


def worker_loop(runner: ModelRunner, channel: WorkerChannel) -> None:
    """Runs until the driver publishes Shutdown."""
    while True:
        msg = channel.recv()
        if isinstance(msg, Shutdown):
            log.info("rank %d: shutdown (%s)", channel.rank, msg.reason or "driver finished")
            return
        result = runner.execute(msg)
        if result is not None:
            channel.send_result(result)
