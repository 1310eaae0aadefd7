"""Keeps this node's replicas running: a replica whose process ends while the deployment
serves is started again (router.restart_limit times in a row, waiting router.restart_backoff
seconds, then twice as long each time), and the front door hears of each step through its
inbox: ReplicaDown (with restart_in when a restart follows) when a replica ends, ReplicaUp
once the restarted one serves. A replica that serves router.restart_reset_s seconds has its
restarts in a row forgotten."""

from __future__ import annotations

import concurrent.futures
import logging
import signal
import threading
import time
from typing import Callable

from meshserve.configs.schema import RouterConfig
from meshserve.engine.serving.replicas.replica_states import ReplicaDown, ReplicaUp
from meshserve.launcher.replicas import ReplicaProcess, stop_replicas, wait_stopped

log = logging.getLogger("meshserve")

MAX_BACKOFF_S = 60.0


class ReplicaKeeper:
    def __init__(self, start: Callable[[int, Callable[[int, str], None]], ReplicaProcess], indices: list[int],
                 policy: RouterConfig, post: Callable[[object], None],
                 on_ready: Callable[[ReplicaProcess], None] = lambda replica: None):
        """`start(index, on_exit)`: replica `index`'s process, started (launcher/replicas.py
        start_replica); `post(event)`: to the front door's inbox; `on_ready(replica)`: a
        restarted replica serves (before the front door hears it)."""
        self.start, self.policy, self.post, self.on_ready = start, policy, post, on_ready
        self.processes: dict[int, ReplicaProcess] = {}
        self._starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshserve-replica-starter")
        """Restarts are started from this one thread, which lives as long as the keeper: a
        replica gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG is
        per thread), and the thread that sees a replica end does end."""
        self.in_a_row = {r: 0 for r in indices}
        self._healing = False
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        for r in indices:
            self.processes[r] = start(r, self._on_exit)

    @property
    def replicas(self) -> list[ReplicaProcess]:
        with self._lock:
            return list(self.processes.values())

    def heal(self) -> None:
        """From now on (every replica served once), a replica that ends is restarted."""
        self._healing = True

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """No more restarts; every replica gets `sig` (SIGTERM: it drains)."""
        with self._lock:
            self._stopping.set()
        stop_replicas(self.replicas, sig)

    def wait(self, timeout: float) -> None:
        wait_stopped(self.replicas, timeout)

    def _on_exit(self, index: int, reason: str) -> None:
        """On the ended replica's own thread: tell the front door, and restart it if it may."""
        replica = self.processes[index]
        if replica.ready_at is not None and time.monotonic() - replica.ready_at >= self.policy.restart_reset_s:
            self.in_a_row[index] = 0
        attempt = self.in_a_row[index]
        if not self._healing or self._stopping.is_set() or attempt >= self.policy.restart_limit:
            if self._healing and not self._stopping.is_set() and self.policy.restart_limit:
                reason += f"; not restarted: it failed {attempt} times in a row (router.restart_limit)"
            self.post(ReplicaDown(index, reason))
            return
        delay = min(self.policy.restart_backoff * 2 ** attempt, MAX_BACKOFF_S)
        self.in_a_row[index] = attempt + 1
        self.post(ReplicaDown(index, reason, restart_in=delay))
        if self._stopping.wait(delay):
            return
        with self._lock:
            if self._stopping.is_set():
                return
            log.warning("replica %d: starting it again (restart %d in a row of at most %d)", index, attempt + 1,
                        self.policy.restart_limit)
            replica = self.processes[index] = self._starter.submit(self.start, index, self._on_exit).result()
        while not replica.ready.wait(0.2):
            if replica.process.poll() is not None or self._stopping.is_set():
                return  # its end comes to _on_exit on its own thread
        self.on_ready(replica)
        self.post(ReplicaUp(index, replica.zmq))
