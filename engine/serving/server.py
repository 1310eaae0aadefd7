"""The driver's busy loop: drain the frontends' commands, then step (vLLM's engine core
loop). Runs on the main thread; each frontend's own thread owns its sockets."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import NoReturn

from meshserve.comm.messages import ErrorReply
from meshserve.configs.adapters import AdapterError
from meshserve.engine.engine import Engine
from meshserve.engine.serving.commands import (AbortCommand, AddCommand, Command, Frontend, Inbox, KvReadyCommand,
                                               LoraCommand, ResetPrefixCacheCommand)
from meshserve.engine.admission import RequestError

log = logging.getLogger(__name__)


class Server:
    def __init__(self, engine: Engine, inbox: Inbox, frontends: list[Frontend], max_waiting: int,
                 max_waiting_tokens: int):
        """Admission is bounded: at most `max_waiting` requests and `max_waiting_tokens`
        uncomputed prompt tokens wait; beyond that a request is refused at once (overloaded)."""
        self.engine, self.inbox, self.max_waiting = engine, inbox, max_waiting
        self.max_waiting_tokens = max_waiting_tokens
        self.frontends = {f.tag: f for f in frontends}
        self.stop_requested = threading.Event()
        self.stop_now = threading.Event()
        """Set with stop_requested: do not wait for running requests, end them now."""

    def request_stop(self, now: bool = False) -> None:
        """From any thread (a signal handler): refuse new requests at once (so /health turns
        503 before anything else does), then drain (`now`: abort) what is running. Every
        request in flight still gets its last message: a final delta, or an error."""
        for frontend in self.frontends.values():
            frontend.accepting = False
        if now:
            self.stop_now.set()
        self.stop_requested.set()

    def send(self, key, message) -> None:
        self.frontends[key.frontend].send(key, message)

    def send_all(self, replies: list) -> None:
        """A step's (key, message) replies, to each frontend in one batch."""
        batches: dict[str, list] = {}
        for key, message in replies:
            batches.setdefault(key.frontend, []).append((key, message))
        for tag, batch in batches.items():
            self.frontends[tag].send_all(batch)

    def run(self, drain_timeout: float = 30.0) -> None:
        """Serve until stop_requested; then refuse new requests, let running ones finish
        for up to `drain_timeout` seconds, abort the rest, and return."""
        for frontend in self.frontends.values():
            frontend.start()
        deadline = None
        failure = self.engine.executor.failure
        while True:
            if failure.is_set():  # the failure reactions answer the clients and end the process
                _park()
            for frontend in self.frontends.values():
                if frontend.error is not None:
                    raise RuntimeError(f"the {frontend.tag} frontend died") from frontend.error
            if self.stop_requested.is_set() and deadline is None:
                for frontend in self.frontends.values():
                    frontend.accepting = False
                deadline = time.monotonic() + drain_timeout
                log.info("draining %d requests", self.engine.num_requests)
            # NOTE: commands before the drain check: a request the frontend accepted before the
            # stop is in the inbox, and is served like one already running.
            for cmd in self._commands(block=not self.engine.has_work() and deadline is None):
                self._handle(cmd)
            if deadline is not None and (not self.engine.has_work() or time.monotonic() > deadline
                                         or self.stop_now.is_set()):
                break
            if self.engine.has_work():
                try:
                    replies = self.engine.step()
                except Exception as e:  # a rank died mid-step, or the step itself failed
                    self._give_up(e)
                self.send_all(replies)
            elif self.engine.observer is not None:
                self.engine.observer.on_idle()
        for key in list(self.engine.requests):
            delta = self.engine.abort(key)
            if delta is not None:
                self.send(key, delta)
        self._refuse_late_commands()

    def _refuse_late_commands(self) -> None:
        """Answer what reached the inbox after the last step (a prompt whose tokenizing ended
        during the drain): the server stops, and no request goes unanswered."""
        for cmd in self._commands(block=False):
            if isinstance(cmd, AddCommand):
                self.send(cmd.key, ErrorReply(cmd.request_id, "unavailable",
                                              "the server is shutting down and accepts no new requests"))
            else:
                self._handle(cmd)

    def _give_up(self, error: Exception) -> NoReturn:
        """The engine cannot go on: report it and wait for the failure reactions (which fail
        every request and end the process; see fail())."""
        failure = self.engine.executor.failure
        # NOTE: the exception's text is for the log only: clients and /health see this reason
        if failure.trigger("a step failed with an internal error (the server log has the traceback)"):
            log.exception("the step failed")
        _park()

    def fail(self, reason: str) -> None:
        """From any thread, once the engine is dead: refuse new requests, and answer every
        request in flight or queued with an error naming `reason`."""
        message = f"the server failed and is exiting: {reason}"
        for frontend in self.frontends.values():
            frontend.accepting = False
        keys = set()
        for _ in range(10):  # the step loop may still be changing the dict
            try:
                keys.update(self.engine.requests)
                break
            except RuntimeError:
                continue
        for cmd in self._commands(block=False):
            if isinstance(cmd, AddCommand):
                keys.add(cmd.key)
        by_frontend: dict[str, list] = {}
        for key in keys:
            by_frontend.setdefault(key.frontend, []).append(key)
        for tag, frontend in self.frontends.items():
            frontend.fail(by_frontend.get(tag, []), message)

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
        elif isinstance(cmd, KvReadyCommand):
            error = self.engine.kv_ready(cmd.key, cmd.token_id, cmd.logprob)
            if error is not None:
                self.send(cmd.key, error)
        elif isinstance(cmd, ResetPrefixCacheCommand):
            cmd.done.set_result(self.engine.reset_prefix_cache())
        elif isinstance(cmd, LoraCommand):
            try:
                if cmd.path is None:
                    self.engine.unload_lora(cmd.name)
                else:
                    self.engine.load_lora(cmd.name, cmd.path)
            except AdapterError as e:
                cmd.done.set_exception(e)
            else:
                cmd.done.set_result(None)
        else:
            self._add(cmd)

    def _add(self, cmd: AddCommand) -> None:
        """Queue `cmd`'s request, unless too much waits already: online requests are bounded
        by the online requests waiting (background ones, which the Batch API's runner bounds
        itself, never crowd them out)."""
        try:
            waiting = [] if cmd.background else [s for s in self.engine.scheduler.waiting if not s.background]
            if len(waiting) >= self.max_waiting:
                raise RequestError("overloaded", f"{len(waiting)} requests are waiting "
                                                 f"(scheduler.max_waiting={self.max_waiting}); retry later")
            tokens = sum(seq.num_uncomputed for seq in waiting)
            adds = len(cmd.prompt_ids) + (len(cmd.resume.token_ids) if cmd.resume is not None else 0)
            if tokens and tokens + adds > self.max_waiting_tokens:
                raise RequestError("overloaded", f"{tokens} prompt tokens are waiting and this request adds "
                                                 f"{adds} (scheduler.max_waiting_tokens="
                                                 f"{self.max_waiting_tokens}); retry later")
            self.engine.add_request(cmd.key, cmd.request_id, cmd.prompt_ids, cmd.params, cmd.stream, cmd.cache_salt,
                                    cmd.grammar, cmd.handoff, cmd.resume, cmd.lora, cmd.priority, cmd.background)
        except RequestError as e:
            self.engine.handoffs.refused(cmd.handoff, len(cmd.prompt_ids))
            self.send(cmd.key, ErrorReply(cmd.request_id, e.code, e.message))


def _park() -> NoReturn:
    """Leave the step loop to the failure reactions, which end the process."""
    while True:
        time.sleep(3600)
