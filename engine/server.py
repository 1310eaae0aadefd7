"""The driver's busy loop: drain the frontend's commands, then step (vLLM's engine core
loop). Runs on the main thread; the frontend's I/O thread owns the sockets."""

from __future__ import annotations

import logging
import queue
import threading
import time

from meshserve.comm.messages import ErrorReply
from meshserve.engine.engine import Engine
from meshserve.engine.frontend import AbortCommand, AddCommand, Command, Frontend
from meshserve.engine.validation import RequestError

log = logging.getLogger(__name__)


class Server:
    def __init__(self, engine: Engine, frontend: Frontend, max_waiting: int):
        self.engine, self.frontend, self.max_waiting = engine, frontend, max_waiting
        self.stop_requested = threading.Event()

    def run(self, drain_timeout: float = 30.0) -> None:
        """Serve until stop_requested; then refuse new requests, let running ones finish
        for up to `drain_timeout` seconds, abort the rest, and return."""
        self.frontend.start()
        deadline = None
        while True:
            if self.frontend.error is not None:
                raise RuntimeError("the frontend I/O thread died") from self.frontend.error
            if self.stop_requested.is_set() and deadline is None:
                self.frontend.accepting = False
                deadline = time.monotonic() + drain_timeout
                log.info("draining %d requests", self.engine.num_requests)
            if deadline is not None and (not self.engine.has_work() or time.monotonic() > deadline):
                break
            for cmd in self._commands(block=not self.engine.has_work()):
                self._handle(cmd)
            if self.engine.has_work():
                for key, delta in self.engine.step():
                    self.frontend.send(key, delta)
        for key in list(self.engine.requests):
            delta = self.engine.abort(key)
            if delta is not None:
                self.frontend.send(key, delta)

    def _commands(self, block: bool) -> list[Command]:
        cmds = []
        try:
            if block:
                cmds.append(self.frontend.inbox.get(timeout=0.05))
            while True:
                cmds.append(self.frontend.inbox.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, AbortCommand):
            delta = self.engine.abort(cmd.key)
            if delta is not None:
                self.frontend.send(cmd.key, delta)
        else:
            self._add(cmd)

    def _add(self, cmd: AddCommand) -> None:
        try:
            if len(self.engine.scheduler.waiting) >= self.max_waiting:
                raise RequestError("overloaded", f"{len(self.engine.scheduler.waiting)} requests are waiting "
                                                 f"(scheduler.max_waiting={self.max_waiting}); retry later")
            self.engine.add_request(cmd.key, cmd.request_id, cmd.prompt_ids, cmd.params, cmd.stream)
        except RequestError as e:
            self.frontend.send(cmd.key, ErrorReply(cmd.request_id, e.code, e.message))
