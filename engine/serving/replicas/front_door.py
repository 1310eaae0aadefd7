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

import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import msgspec
import zmq

from meshserve.comm.messages import (Constraint, ErrorReply, GenerateRequest, KvHandoff, KvReady, KvReserved,
                                     PrefillDone)
from meshserve.configs.roles import ReplicaRole, role_of
from meshserve.configs.adapters import AdapterError
from meshserve.engine.serving.commands import (AbortCommand, AddCommand, Frontend, Inbox, LoraCommand, RequestKey,
                                               ResetPrefixCacheCommand)
from meshserve.engine.serving.replicas.admin import AdminCommand, AdminError
from meshserve.engine.serving.replicas.link import ReplicaLink
from meshserve.engine.serving.replicas.pending import Pending, Phase
from meshserve.engine.serving.replicas.prefix_index import prefix_hashes
from meshserve.engine.serving.replicas.replica_states import (ReplicaDown, ReplicaLeaving, ReplicaStates, ReplicaUp,
                                                              State)
from meshserve.engine.serving.replicas.routing import Route, Router

log = logging.getLogger("meshserve")

POLL_MS = 100
RETRYABLE = ("unavailable", "overloaded")
"""A replica's errors that say nothing of the request itself: another replica may take it."""


class ReplicaControl(Protocol):
    """What starts and stops the replicas for the admin API (launcher/replica_keeper.py).
    Called on the front door's loop: none of it blocks."""

    def manages(self, replica: int) -> bool: ...

    def refuses(self, op: str, replica: int | None) -> str | None:
        """Why it cannot do `op` (drain, restart, add, remove) to `replica`, or None."""

    def stop(self, replica: int, then: str, sets: list[str] | None) -> None:
        """Stop it (it has no requests left); `then`: `restart` (with `sets`, if given),
        `stop` or `remove`."""

    def start(self, replica: int, sets: list[str] | None) -> None:
        """Start a stopped or failed replica again."""

    def add(self, replica: int, sets: list[str]) -> None:
        """Start a new replica, number `replica`."""


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
                 migration_limit: int = 3, connect: Callable[[int, str], ReplicaLink] | None = None,
                 control: ReplicaControl | None = None, states: ReplicaStates | None = None,
                 open_ended: bool = False, change_adapter: Callable[[int | None, str, str | None], None] | None = None):
        """`observer`: told of routes, retries, moves and replica failures (RouterMetrics).
        `reset_prefix_caches()`: forgets every replica's prefix cache, returns the blocks
        forgotten (run on a thread of its own). `prefill_replicas`: disaggregated
        prefill/decode: the first this many replicas compute prompts, the rest decode (the
        router picks among those). `migration_limit`: how often a request with output may
        move to another replica. `connect(replica, address)`: a link to a restarted replica.
        `control`: starts and stops the replicas (the admin API's drain, restart, add and
        remove; None: it is off). `states`: where each replica's state is kept (shared with
        /metrics). `open_ended`: replicas join at any time (`meshserve router`): serve until
        stopped, whatever the replicas do. `change_adapter(replica, name, path)`: loads (path
        set) or unloads a LoRA adapter on a replica (None: every replica up), raising
        AdapterError with a replica's reason (run on a thread of its own)."""
        self.change_adapter = change_adapter
        self._adapter_changes: list[tuple[str, str | None]] = []
        """The adapters loaded and unloaded at run time, in order: a restarted replica, which
        starts with lora.adapters, gets them again."""
        self.open_ended = open_ended
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
        self.control = control
        self.states = states if states is not None else ReplicaStates(len(links))
        self._connected: set[int] = set(range(len(links)))
        """The replicas whose links are open (serving or draining)."""
        self._drains: dict[int, _Drain] = {}
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
        while not self._stopped() if self.open_ended else self.states.may_serve_again():
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                log.warning("replicas %s did not report their end: giving up on them",
                            [r for r in range(len(self.links)) if self.states.serving(r)])
                break
            for frontend in self.frontends.values():
                if frontend.error is not None:
                    raise RuntimeError(f"the {frontend.tag} frontend died") from frontend.error
            events = dict(self._poller.poll(POLL_MS))
            for r in sorted(self._connected):
                if self.links[r].socket in events:
                    for reply in self.links[r].receive():
                        self._on_reply(r, reply)
            for cmd in self.inbox.take_all():
                if isinstance(cmd, ReplicaDown):
                    failed = self._on_down(cmd) or failed
                elif isinstance(cmd, ReplicaUp):
                    self._on_up(cmd)
                elif isinstance(cmd, ReplicaLeaving):
                    self._on_leaving(cmd)
                elif isinstance(cmd, AdminCommand):
                    self._on_admin(cmd)
                else:
                    self._on_command(cmd)
            if self._drains:
                self._check_drains()
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
        elif isinstance(cmd, LoraCommand):
            threading.Thread(target=self._change_adapter, args=(cmd,), daemon=True).start()

    def _change_adapter(self, cmd: LoraCommand) -> None:
        """On its thread: the change on every replica up, kept for the ones that restart."""
        if self.change_adapter is None:
            cmd.done.set_exception(AdapterError("this front door cannot change its replicas' adapters"))
            return
        try:
            self.change_adapter(None, cmd.name, cmd.path)
        except Exception as e:  # reported to the HTTP caller
            cmd.done.set_exception(e)
            return
        self._adapter_changes.append((cmd.name, cmd.path))
        cmd.done.set_result(None)

    def _replay_adapters(self, replica: int) -> None:
        """On its thread: a restarted replica gets the adapters loaded and unloaded since the start."""
        for name, path in list(self._adapter_changes):
            try:
                self.change_adapter(replica, name, path)
            except Exception as e:  # noqa: BLE001 - the replica serves on; its requests of that adapter fail
                log.warning("replica %d: could not %s LoRA adapter %r again: %s", replica,
                            "load" if path else "unload", name, e)

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
        prefill = self._pick_prefill(cmd) if self.prefill_replicas and resume is None else None
        if prefill is not None:
            p.prefill, p.transfer, p.phase = prefill, next(self._transfers) % (1 << 31), Phase.RESERVING
            handoff = KvHandoff(p.transfer, prefill, ReplicaRole.DECODE)
        route: Route | None = self.router.route(cmd.prompt_ids, cmd.cache_salt, exclude=p.tried | self.prefill_replicas,
                                                adapter=cmd.lora)
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
        self.router.started(cmd.key, route, cmd.prompt_ids, cmd.cache_salt, cmd.lora)
        self.router.produced(cmd.key, p.output)
        if self.observer is not None:
            self.observer.routed_to(route)
        grammar = None if cmd.grammar is None else Constraint(**_spec_fields(cmd.grammar.spec))
        params = cmd.params
        if resume is not None and params.prompt_logprobs is not None:  # the client had them with its first tokens
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        self.links[route.replica].send(GenerateRequest(link_id, prompt_token_ids=cmd.prompt_ids, params=params,
                                                       stream=True, cache_salt=cmd.cache_salt, constraint=grammar,
                                                       handoff=handoff, resume=resume, lora=cmd.lora,
                                                       priority=cmd.priority, background=cmd.background))

    # ------------------------------------------------------------------ disaggregated prefill/decode

    def _pick_prefill(self, cmd: AddCommand) -> int | None:
        """The prefill replica with the fewest prompt tokens to compute; with router.policy
        cache_aware, the one whose prefix cache holds the longest prefix of the prompt (as
        the prompts it computed say), unless it is overloaded as the router judges it."""
        up = [r for r in sorted(self.prefill_replicas) if self.states.serving(r)]
        if not up:
            return None
        least = min(up, key=lambda r: (self._prefill_load[r], r))
        if self.router.policy != "cache_aware":
            return least
        hashes = prefix_hashes(cmd.prompt_ids, self.router.block_size, cmd.cache_salt)
        matches = {r: self.router.indexes[r].match(hashes) for r in up}
        best = max(matches.values())
        if not best:
            return least
        cached = min((r for r in up if matches[r] == best), key=lambda r: (self._prefill_load[r], r))
        excess = self._prefill_load[cached] - self._prefill_load[least]
        if excess > self.router.balance_abs_tokens and self._prefill_load[cached] > (
                self.router.balance_rel * self._prefill_load[least]):
            return least
        return cached

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
        self.router.indexes[p.prefill].add(prefix_hashes(cmd.prompt_ids, self.router.block_size, cmd.cache_salt))
        grammar = None if cmd.grammar is None else Constraint(**_spec_fields(cmd.grammar.spec))
        first_block = reply.cached_tokens // self.router.block_size
        handoff = KvHandoff(p.transfer, p.replica, ReplicaRole.PREFILL, first_block)
        self.links[p.prefill].send(GenerateRequest(link_id, prompt_token_ids=cmd.prompt_ids, params=cmd.params,
                                                   stream=False, cache_salt=cmd.cache_salt, constraint=grammar,
                                                   handoff=handoff, priority=cmd.priority, background=cmd.background))
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
        drain = self._drains.pop(r, None)
        self.states.down(event, self.stopping.is_set(), removed=drain is not None and drain.then == "remove")
        expected = event.expected or self.stopping.is_set()
        if r not in self._connected:
            if not expected:
                log.error("replica %d: %s%s", r, event.reason, _restart_note(event))
            return not expected
        self._connected.discard(r)
        self._poller.unregister(self.links[r].socket)
        self.router.set_up(r, False)
        self.links[r].close()
        if self.observer is not None and not expected:
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
            self._move_off(link_id, p, r, event.reason, f"replica {r} failed: {event.reason}")
        return not expected

    def _move_off(self, link_id: str, p: Pending, r: int, why: str, error: str) -> None:
        """`p` leaves replica `r` (failed or drained): its last delta if it was aborted, else
        on to another replica if it may go, else `unavailable` with `error`."""
        self._forget(link_id, completed=False)
        if p.aborted:
            self._reply(p, p.aborted_delta())
        elif self._may_retry(p):
            p.tried = {r}  # the replicas it left before may serve again
            self._retry(p, why)
        else:
            self._reply(p, ErrorReply(p.cmd.request_id, "unavailable", error))

    def _on_up(self, event: ReplicaUp) -> None:
        """A restarted replica serves: a new link to it, and it takes requests again."""
        r = event.replica
        if r in self._connected or self.stopping.is_set() or self.connect is None:
            return
        while r >= len(self.states):  # a replica that joined for the first time
            self.states.add()
            self.links.append(None)
            self.router.add_replica()
        if event.name is not None:
            self.states.names[r] = event.name
        self.links[r] = self.connect(r, event.zmq)
        self._poller.register(self.links[r].socket, zmq.POLLIN)
        self._connected.add(r)
        added = self.states.state[r] is State.STARTING
        self.states.up(r)
        self.router.set_up(r, True)
        if self.observer is not None and not added:
            self.observer.replica_up(r)
        if self._adapter_changes and self.change_adapter is not None:
            threading.Thread(target=self._replay_adapters, args=(r,), daemon=True).start()
        log.warning("replica %d serves%s; %d of %d replicas serve", r,
                    "" if added else f" again (restart {self.states.restarts[r]})",
                    len(self._connected), self.states.health()[1]["replicas"]["total"])

    def _on_leaving(self, event: ReplicaLeaving) -> None:
        r = event.replica
        if r in self._connected and self.states.serving(r):
            self.states.draining(r, event.reason)
            self.router.set_up(r, False)
            log.warning("replica %d: %s; %d of %d replicas serve", r, event.reason,
                        len(self._connected) - 1, len(self._connected))

    def _stopped(self) -> bool:
        """Stopping, with no request left (an open-ended front door's end)."""
        return self.stopping.is_set() and not self._pending

    # ------------------------------------------------------------------ the admin API

    def _on_admin(self, cmd: AdminCommand) -> None:
        try:
            cmd.done.set_result(self._admin(cmd))
        except AdminError as e:
            cmd.done.set_exception(e)

    def _admin(self, cmd: AdminCommand) -> dict:
        if cmd.op == "list":
            return {"replicas": self.replica_list()}
        if self.stopping.is_set():
            raise AdminError(409, "the server is shutting down")
        if self.control is None:
            raise AdminError(409, "this front door does not start its replicas: their launchers do")
        refused = self.control.refuses(cmd.op, cmd.replica)
        if refused is not None:
            raise AdminError(409, refused)
        if cmd.op == "add":
            if self.prefill_replicas:
                raise AdminError(409, "adding replicas is not available with disaggregated prefill/decode")
            r = self.states.add()
            self.links.append(None)
            self.router.add_replica()
            self.control.add(r, cmd.sets or [])
            return {"replica": r, "state": State.STARTING.value}
        r = cmd.replica
        if not 0 <= r < len(self.states):
            raise AdminError(404, f"no replica {r} (replicas 0..{len(self.states) - 1})")
        if not self.control.manages(r):
            raise AdminError(409, f"replica {r} was not started by this front door: its own launcher stops it")
        state = self.states.state[r]
        if state is State.SERVING:
            if len(self._connected - set(self._drains)) == 1:
                log.warning("replica %d: the admin API takes the last serving replica out (%s)", r, cmd.op)
            self._drains[r] = _Drain("stop" if cmd.op == "drain" else cmd.op, cmd.sets,
                                     time.monotonic() + cmd.timeout)
            self.states.draining(r, f"draining ({cmd.op} by the admin API)")
            self.router.set_up(r, False)
            log.warning("replica %d: draining (%s by the admin API): it takes no new requests", r, cmd.op)
            return {"replica": r, "state": State.DRAINING.value}
        if state in (State.STOPPED, State.FAILED) and cmd.op == "restart":
            self.states.state[r], self.states.reason[r] = State.RESTARTING, "started by the admin API"
            self.control.start(r, cmd.sets)
            return {"replica": r, "state": State.RESTARTING.value}
        if state in (State.STOPPED, State.FAILED) and cmd.op == "remove":
            self.states.state[r], self.states.reason[r] = State.REMOVED, "removed"
            return {"replica": r, "state": State.REMOVED.value}
        raise AdminError(409, f"replica {r} is {state.value}: it cannot be {_DONE[cmd.op]} now")

    def replica_list(self) -> list[dict]:
        out = self.states.listed()
        for item in out:
            r = item["replica"]
            if r in self._connected:
                item.update(address=self.links[r].address, requests=self.router.requests(r),
                            load_tokens=self.router.load(r))
            if self.roles is not None and r < len(self.roles):
                item["role"] = self.roles[r].value
        return out

    def _check_drains(self) -> None:
        """A draining replica with nothing left stops (then restarts, or is removed); one
        past its timeout has its requests moved to other replicas first."""
        now = time.monotonic()
        for r, drain in list(self._drains.items()):
            if drain.stopping:
                continue
            left = [i for i, p in self._pending.items() if r in (p.replica, p.prefill)]
            if left and now < drain.deadline:
                continue
            for link_id in left:
                p = self._pending[link_id]
                if p.replica == r:
                    self.links[r].abort(link_id)
                    if p.phase is Phase.PREFILLING and p.prefill in self._connected:
                        self.links[p.prefill].abort(link_id)
                else:
                    self.links[p.replica].abort(link_id)
                    self.links[r].abort(link_id)
                self._move_off(link_id, p, r, f"replica {r} drained for {drain.then}", f"replica {r} was drained")
            drain.stopping = True
            log.warning("replica %d: drained (%d requests moved); %s", r, len(left),
                        {"stop": "stopping it", "restart": "restarting it", "remove": "removing it"}[drain.then])
            self.control.stop(r, drain.then, drain.sets)

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


@dataclass
class _Drain:
    then: str
    """`stop`, `restart` or `remove` once drained."""
    sets: list[str] | None
    deadline: float
    stopping: bool = False


_DONE = {"drain": "drained", "restart": "restarted", "remove": "removed"}


def _restart_note(event: ReplicaDown) -> str:
    return "" if event.restart_in is None else f" (restarted in {event.restart_in:.1f} s)"


def _spec_fields(spec) -> dict:
    return dataclasses.asdict(spec)


def _settle(done, fn) -> None:
    try:
        done.set_result(fn())
    except Exception as e:  # reported to the HTTP caller
        done.set_exception(e)
