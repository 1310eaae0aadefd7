"""The driver's busy loop: drain the frontends' commands, then step (vLLM's engine core
loop). Runs on the main thread; each frontend's own thread owns its sockets."""

from __future__ import annotations

import logging
import queue
import threading
import time

from meshserve.comm.messages import ErrorReply
from meshserve.engine.engine import Engine
from meshserve.engine.commands import AbortCommand, AddCommand, Command, Frontend, Inbox
from meshserve.engine.validation import RequestError

log = logging.getLogger(__name__)


class Server:
    def __init__(self, engine: Engine, inbox: Inbox, frontends: list[Frontend], max_waiting: int):
        self.engine, self.inbox, self.max_waiting = engine, inbox, max_waiting
        self.frontends = {f.tag: f for f in frontends}
        self.stop_requested = threading.Event()

    def send(self, key, message) -> None:
        self.frontends[key[0]].send(key, message)

    def run(self, drain_timeout: float = 30.0) -> None:
        """Serve until stop_requested; then refuse new requests, let running ones finish
        for up to `drain_timeout` seconds, abort the rest, and return."""
        for frontend in self.frontends.values():
            frontend.start()
        deadline = None
        while True:
            for frontend in self.frontends.values():
                if frontend.error is not None:
                    raise RuntimeError(f"the {frontend.tag} frontend died") from frontend.error
            if self.stop_requested.is_set() and deadline is None:
                for frontend in self.frontends.values():
                    frontend.accepting = False
                deadline = time.monotonic() + drain_timeout
                log.info("draining %d requests", self.engine.num_requests)
            if deadline is not None and (not self.engine.has_work() or time.monotonic() > deadline):
                break
            for cmd in self._commands(block=not self.engine.has_work()):
                self._handle(cmd)
            if self.engine.has_work():
                for key, delta in self.engine.step():
                    self.send(key, delta)
        for key in list(self.engine.requests):
            delta = self.engine.abort(key)
            if delta is not None:
                self.send(key, delta)

    def _commands(self, block: bool) -> list[Command]:
        cmds = []
        try:
            if block:
                cmds.append(self.inbox.get(timeout=0.05))
            while True:
                cmds.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, AbortCommand):
            delta = self.engine.abort(cmd.key)
            if delta is not None:
                self.send(cmd.key, delta)
        else:
            self._add(cmd)

    def _add(self, cmd: AddCommand) -> None:
        try:
            if len(self.engine.scheduler.waiting) >= self.max_waiting:
                raise RequestError("overloaded", f"{len(self.engine.scheduler.waiting)} requests are waiting "
                                                 f"(scheduler.max_waiting={self.max_waiting}); retry later")
            self.engine.add_request(cmd.key, cmd.request_id, cmd.prompt_ids, cmd.params, cmd.stream)
        except RequestError as e:
            self.send(cmd.key, ErrorReply(cmd.request_id, e.code, e.message))
