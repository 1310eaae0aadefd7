"""The front door of several replicas: the frontends' requests (the same ZMQ and HTTP
frontends a single replica serves with) go to the replica the router picks, over a
ReplicaLink; every reply comes back to the frontend that owns the request. One thread
(the process's main one) runs the loop and owns the links, as the step loop owns the engine.

A replica that fails is taken out and the rest of the deployment goes on serving. Its
requests move to another replica: those with no output yet start over (router.retry), the
others continue from their output so far (migration, comm/messages.py Resume: the new
replica computes the prompt and that output and streams what follows), up to
router.migration_limit moves each. The replicas stream every request to the front door,
which answers a whole (unstreamed) request once, so it can move those with their output
too. The launcher may restart the replica (ReplicaDown.restart_in); it takes traffic again
once it serves (ReplicaUp). /health says `degraded` (HTTP 200, so a load balancer keeps
sending) while at least one replica serves; with none, 503 `failed`.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import Callable

import msgspec
import zmq

from meshserve.comm.messages import (Constraint, ErrorReply, GenerateRequest, KvHandoff, KvReady, KvReserved,
                                     PrefillDone)
from meshserve.configs.roles import ReplicaRole, role_of
from meshserve.engine.serving.commands import (AbortCommand, AddCommand, Frontend, Inbox, RequestKey,
                                               ResetPrefixCacheCommand)
from meshserve.engine.serving.replicas.link import ReplicaLink
from meshserve.engine.serving.replicas.pending import Pending, Phase
from meshserve.engine.serving.replicas.replica_states import ReplicaDown, ReplicaStates, ReplicaUp, State
from meshserve.engine.serving.replicas.routing import Route, Router

log = logging.getLogger("meshserve")

POLL_MS = 100
RETRYABLE = ("unavailable", "overloaded")
"""A replica's errors that say nothing of the request itself: another replica may take it."""


class WakingInbox(Inbox):
    """The frontends' queue, with a pipe the loop polls beside the replicas' sockets, so a
    new request wakes it at once."""

    def __init__(self) -> None:
        super().__init__()
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:  # the pipe is full: the loop has wake-ups enough
            pass

    def fileno(self) -> int:
        return self._read

    def take_all(self) -> list:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        items = []
        try:
            while True:
                items.append(self.get_nowait())
        except queue.Empty:
            return items

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


class FrontDoor:
    def __init__(self, inbox: WakingInbox, frontends: list[Frontend], links: list[ReplicaLink], router: Router,
                 retry: bool = True, observer=None, reset_prefix_caches=None, prefill_replicas: int = 0,
                 migration_limit: int = 3, connect: Callable[[int, str], ReplicaLink] | None = None):
        """`observer`: told of routes, retries, moves and replica failures (RouterMetrics).
        `reset_prefix_caches()`: forgets every replica's prefix cache, returns the blocks
        forgotten (run on a thread of its own). `prefill_replicas`: disaggregated
        prefill/decode: the first this many replicas compute prompts, the rest decode (the
        router picks among those). `migration_limit`: how often a request with output may
        move to another replica. `connect(replica, address)`: a link to a restarted replica."""
        self.roles = [role_of(r, prefill_replicas) for r in range(len(links))] if prefill_replicas else None
        """Each replica's role in disaggregated prefill/decode; None without it."""
        self.prefill_replicas = frozenset(r for r, role in enumerate(self.roles or []) if role is ReplicaRole.PREFILL)
        """The replicas that compute prompts; the router picks among the others."""
        self._prefill_load = {r: 0 for r in self.prefill_replicas}
        """Prompt tokens each prefill replica has been given and not finished."""
        self._transfers = itertools.count()
        self.inbox, self.links, self.router, self.retry = inbox, links, router, retry
        self.migration_limit, self.connect = migration_limit, connect
        self.frontends = {f.tag: f for f in frontends}
        self.observer = observer
        self.reset_prefix_caches = reset_prefix_caches
        self.states = ReplicaStates(len(links))
        self._poller = zmq.Poller()
        self.stopping = threading.Event()
        self._pending: dict[str, Pending] = {}
        """By the id the front door gave the request on its replica's link."""
        self._link_ids: dict[RequestKey, str] = {}
        self._ids = (str(i) for i in itertools.count())
        self._stop_deadline: float | None = None

    # ------------------------------------------------------------------ any thread

    def request_stop(self, timeout: float | None = None) -> None:
        """Refuse new requests; the loop ends once every replica has stopped, or after
        `timeout` seconds (a replica that never reports its end)."""
        for frontend in self.frontends.values():
            frontend.accepting = False
        if timeout is not None:
            self._stop_deadline = time.monotonic() + timeout
        self.stopping.set()

    def health(self) -> tuple[int, dict]:
        return self.states.health()

    @property
    def down(self) -> dict[int, str]:
        """Replicas out of service -> why."""
        return self.states.out()

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Serve until every replica is down (stopped or failed, none being restarted); 0 if
        they were stopped, 1 if they all failed."""
        for frontend in self.frontends.values():
            frontend.start()
        self._poller.register(self.inbox.fileno(), zmq.POLLIN)
        for link in self.links:
            self._poller.register(link.socket, zmq.POLLIN)
        failed = False
        while self.states.may_serve_again():
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                log.warning("replicas %s did not report their end: giving up on them",
                            [r for r in range(len(self.links)) if self.states.serving(r)])
                break
            for frontend in self.frontends.values():
                if frontend.error is not None:
                    raise RuntimeError(f"the {frontend.tag} frontend died") from frontend.error
            events = dict(self._poller.poll(POLL_MS))
            for link in self.links:
                if link.socket in events and self.states.serving(link.index):
                    for reply in link.receive():
                        self._on_reply(link.index, reply)
            for cmd in self.inbox.take_all():
                if isinstance(cmd, ReplicaDown):
                    failed = self._on_down(cmd) or failed
                elif isinstance(cmd, ReplicaUp):
                    self._on_up(cmd)
                else:
                    self._on_command(cmd)
        for p in list(self._pending.values()):
            self._reply(p, ErrorReply(p.cmd.request_id, "unavailable", "the server stopped"))
        return 1 if failed and not self.stopping.is_set() else 0

    def _on_command(self, cmd) -> None:
        if isinstance(cmd, AddCommand):
            if cmd.key in self._link_ids:  # as the engine answers a client reusing a running id
                self.frontends[cmd.key.frontend].send(cmd.key, ErrorReply(
                    cmd.request_id, "duplicate_id", f"request_id {cmd.request_id!r} is already running"))
                return
            self._send(Pending(cmd, -1))
        elif isinstance(cmd, AbortCommand):
            link_id = self._link_ids.get(cmd.key)
            if link_id is not None:
                p = self._pending[link_id]
                self.links[p.replica].abort(link_id)
                if p.phase is Phase.PREFILLING:
                    self.links[p.prefill].abort(link_id)
                p.aborted = True
        elif isinstance(cmd, ResetPrefixCacheCommand):
            for index in self.router.indexes:
                index.clear()
            if self.reset_prefix_caches is None:
                cmd.done.set_result(0)
            else:
                threading.Thread(target=lambda: _settle(cmd.done, self.reset_prefix_caches), daemon=True).start()

    def _send(self, p: Pending) -> None:
        """Route `p` to a replica it has not tried, or answer it with an error. A request
        with output goes on from it (migration); under disaggregation it is then served
        whole by a decode replica, as is every request while no prefill replica serves."""
        cmd = p.cmd
        if self.stopping.is_set() and p.tried:
            self._reply(p, ErrorReply(cmd.request_id, "unavailable", "the server is shutting down"))
            return
        handoff, resume = None, p.resume()
        p.phase, p.prefill = Phase.WHOLE, None
        prefill = self._pick_prefill() if self.prefill_replicas and resume is None else None
        if prefill is not None:
            p.prefill, p.transfer, p.phase = prefill, next(self._transfers) % (1 << 31), Phase.RESERVING
            handoff = KvHandoff(p.transfer, prefill, ReplicaRole.DECODE)
        route: Route | None = self.router.route(cmd.prompt_ids, cmd.cache_salt, exclude=p.tried | self.prefill_replicas)
        if route is None:
            why = "; ".join(f"replica {r}: {reason}" for r, reason in sorted(self.down.items())) or "none up"
            self._reply(p, ErrorReply(cmd.request_id, "unavailable",
                                      f"no replica can take the request ({len(self.down)} of {len(self.links)} out of "
                                      f"service: {why})"))
            return
        link_id = next(self._ids)
        p.replica = route.replica
        p.tried.add(route.replica)
        self._pending[link_id] = p
        self._link_ids[cmd.key] = link_id
        self.router.started(cmd.key, route, cmd.prompt_ids, cmd.cache_salt)
        self.router.produced(cmd.key, p.output)
        if self.observer is not None:
            self.observer.routed_to(route)
        grammar = None if cmd.grammar is None else Constraint(**_spec_fields(cmd.grammar.spec))
        params = cmd.params
        if resume is not None and params.prompt_logprobs is not None:  # the client had them with its first tokens
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        self.links[route.replica].send(GenerateRequest(link_id, prompt_token_ids=cmd.prompt_ids, params=params,
                                                       stream=True, cache_salt=cmd.cache_salt, constraint=grammar,
                                                       handoff=handoff, resume=resume))

    # ------------------------------------------------------------------ disaggregated prefill/decode

    def _pick_prefill(self) -> int | None:
        """The prefill replica with the fewest prompt tokens to compute."""
        up = [r for r in sorted(self.prefill_replicas) if r not in self.down]
        return min(up, key=lambda r: self._prefill_load[r]) if up else None

    def _on_reserved(self, link_id: str, p: Pending, reply: KvReserved) -> None:
        """The decode replica reserved the blocks and posted its receives: the prefill
        replica computes the prompt. It is told even if the request was aborted meanwhile
        (and aborted there at once), as only it can answer those receives."""
        if p.phase is not Phase.RESERVING:
            return
        if p.prefill in self.down:
            self._prefill_failed(link_id, p, f"prefill replica {p.prefill} failed: {self.down[p.prefill]}")
            return
        p.phase = Phase.PREFILLING
        cmd = p.cmd
        p.prefill_tokens = len(cmd.prompt_ids) - reply.cached_tokens
        self._prefill_load[p.prefill] += p.prefill_tokens
        grammar = None if cmd.grammar is None else Constraint(**_spec_fields(cmd.grammar.spec))
        first_block = reply.cached_tokens // self.router.block_size
        handoff = KvHandoff(p.transfer, p.replica, ReplicaRole.PREFILL, first_block)
        self.links[p.prefill].send(GenerateRequest(link_id, prompt_token_ids=cmd.prompt_ids, params=cmd.params,
                                                   stream=False, cache_salt=cmd.cache_salt, constraint=grammar,
                                                   handoff=handoff))
        if p.aborted:  # after the reservation: the prefill replica ends the receives it posted (with zeros)
            self.links[p.prefill].abort(link_id)

    def _on_prefill_reply(self, link_id: str, p: Pending, reply) -> None:
        if p.phase is not Phase.PREFILLING:
            return
        if isinstance(reply, PrefillDone):
            self._prefilled(p)
            p.phase = Phase.DECODING
            self.links[p.replica].send(KvReady(link_id, reply.token_id, reply.logprob))
        elif isinstance(reply, ErrorReply):
            self._prefill_failed(link_id, p, f"prefill replica {p.prefill}: {reply.code}: {reply.message}",
                                 reply.code)

    def _prefilled(self, p: Pending) -> None:
        """`p`'s prefill ended (done, failed or aborted): its prefill replica's load drops."""
        if p.phase is Phase.PREFILLING:
            self._prefill_load[p.prefill] -= p.prefill_tokens
            p.phase = Phase.PREFILLED

    def _prefill_failed(self, link_id: str, p: Pending, why: str, code: str = "unavailable") -> None:
        """The prompt will not be computed: free the decode replica's blocks, then start over
        (another prefill replica may serve) or answer the client."""
        self.links[p.replica].abort(link_id)
        self._forget(link_id, completed=False)
        p.tried.discard(p.replica)  # the decode replica did nothing wrong
        if code in RETRYABLE and self._may_retry(p):
            self._retry(p, why)
        else:
            self._reply(p, ErrorReply(p.cmd.request_id, code if code in RETRYABLE else "internal", why))

    # ------------------------------------------------------------------ replies

    def _on_reply(self, replica: int, reply) -> None:
        p = self._pending.get(reply.request_id) if reply.request_id is not None else None
        if p is not None and replica == p.prefill and replica != p.replica:
            self._on_prefill_reply(reply.request_id, p, reply)
            return
        if p is not None and isinstance(reply, KvReserved):
            if replica == p.replica:
                self._on_reserved(reply.request_id, p, reply)
            return
        if isinstance(reply, PrefillDone):
            return
        if p is None or p.replica != replica:
            if isinstance(reply, ErrorReply) and reply.request_id is None:
                log.error("replica %d: %s: %s", replica, reply.code, reply.message)
            return
        key = p.cmd.key
        if isinstance(reply, ErrorReply):
            if p.phase is Phase.PREFILLING:  # the decode side is gone: the prompt is computed for nothing
                self.links[p.prefill].abort(reply.request_id)
            self._forget(reply.request_id, completed=False)
            if reply.code in RETRYABLE and self._may_retry(p):
                self._retry(p, f"{reply.code}: {reply.message}")
                return
            if reply.code in RETRYABLE:  # the replica's state, not the request's: say which
                reply = msgspec.structs.replace(reply, message=f"replica {replica}: {reply.message}")
            self._reply(p, reply)
            return
        if reply.token_ids:
            self.router.produced(key, reply.token_ids)
        if reply.finish_reason is not None:
            self._forget(reply.request_id, completed=reply.finish_reason != "abort")
        out = p.took(reply)
        if out is not None:
            self._reply(p, out)

    def _may_retry(self, p: Pending) -> bool:
        """Whether `p` may go to another replica: it has no output yet (router.retry), or
        it may move once more (router.migration_limit)."""
        if not self.retry or self.stopping.is_set() or p.aborted:
            return False
        return not p.output or p.moves < self.migration_limit

    def _retry(self, p: Pending, why: str) -> None:
        moving = bool(p.output)
        log.warning("request %s: replica %d could not serve it (%s); %s", p.cmd.request_id, p.replica, why,
                    f"moving it to another with its {len(p.output)} output tokens" if moving else "trying another")
        if self.observer is not None:
            (self.observer.migrated if moving else self.observer.retried)(p.replica)
        p.moves += moving
        self._send(p)

    def _on_down(self, event: ReplicaDown) -> bool:
        """Take the replica out (or note what became of one already out: a restart that
        failed); whether it failed (rather than stopped)."""
        r = event.replica
        was_serving = self.states.serving(r)
        self.states.down(event, self.stopping.is_set())
        expected = self.states.state[r] is State.STOPPED
        if not was_serving:
            if not expected:
                log.error("replica %d: %s%s", r, event.reason, _restart_note(event))
            return not expected
        self._poller.unregister(self.links[r].socket)
        self.router.set_up(r, False)
        self.links[r].close()
        if self.observer is not None:
            self.observer.replica_down(r)
        if not expected:
            log.error("replica %d is out of service: %s%s; %d of %d replicas serve", r, event.reason,
                      _restart_note(event), len(self.links) - len(self.down), len(self.links))
        for link_id in [i for i, p in self._pending.items()
                        if p.prefill == r and p.phase in (Phase.RESERVING, Phase.PREFILLING)]:
            self._prefill_failed(link_id, self._pending[link_id], f"prefill replica {r} failed: {event.reason}")
        for link_id in [i for i, p in self._pending.items() if p.replica == r]:
            p = self._pending[link_id]
            if p.phase is Phase.PREFILLING and p.prefill not in self.down:
                self.links[p.prefill].abort(link_id)
            self._forget(link_id, completed=False)
            if p.aborted:
                self._reply(p, p.aborted_delta())
            elif self._may_retry(p):
                p.tried = {r}  # the replicas it left before may serve again
                self._retry(p, event.reason)
            else:
                self._reply(p, ErrorReply(p.cmd.request_id, "unavailable", f"replica {r} failed: {event.reason}"))
        return not expected

    def _on_up(self, event: ReplicaUp) -> None:
        """A restarted replica serves: a new link to it, and it takes requests again."""
        r = event.replica
        if self.states.serving(r) or self.stopping.is_set() or self.connect is None:
            return
        self.links[r] = self.connect(r, event.zmq)
        self._poller.register(self.links[r].socket, zmq.POLLIN)
        self.states.up(r)
        self.router.set_up(r, True)
        if self.observer is not None:
            self.observer.replica_up(r)
        log.warning("replica %d serves again (restart %d); %d of %d replicas serve", r, self.states.restarts[r],
                    len(self.links) - len(self.down), len(self.links))

    def _forget(self, link_id: str, completed: bool) -> None:
        p = self._pending.pop(link_id)
        self._prefilled(p)
        self._link_ids.pop(p.cmd.key, None)
        self.router.finished(p.cmd.key, completed)

    def _reply(self, p: Pending, message) -> None:
        """To the client, under its own request id."""
        if message.request_id != p.cmd.request_id:
            message = msgspec.structs.replace(message, request_id=p.cmd.request_id)
        self.frontends[p.cmd.key.frontend].send(p.cmd.key, message)


def _restart_note(event: ReplicaDown) -> str:
    return "" if event.restart_in is None else f" (restarted in {event.restart_in:.1f} s)"


def _spec_fields(spec) -> dict:
    return {"kind": spec.kind, "value": spec.value, "prefix": spec.prefix, "suffix": spec.suffix, "param": spec.param}


def _settle(done, fn) -> None:
    try:
        done.set_result(fn())
    except Exception as e:  # reported to the HTTP caller
        done.set_exception(e)
