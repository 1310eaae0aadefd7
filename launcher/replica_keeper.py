"""Keeps this node's replicas running, and starts and stops them for the admin API.

A replica whose process ends while the deployment serves is started again
(router.restart_limit times in a row, waiting router.restart_backoff seconds, then twice as
long each time); one that serves router.restart_reset_s seconds has its restarts in a row
forgotten. The front door hears of each step through its inbox: ReplicaDown (restart_in
set when a start follows) when a replica ends, ReplicaUp once a started one serves.

For the admin API (the front door's ReplicaControl) it stops a drained replica, then
starts it again with new overrides (restart) or leaves it stopped, and starts added ones.
"""

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

Start = Callable[[int, Callable[[int, str], None], list[str]], ReplicaProcess]


class ReplicaKeeper:
    def __init__(self, start: Start, indices: list[int], policy: RouterConfig, post: Callable[[object], None],
                 on_ready: Callable[[ReplicaProcess], None] = lambda replica: None):
        """`start(index, on_exit, sets)`: replica `index`'s process, started with the config
        overrides `sets` (launcher/replicas.py start_replica); `post(event)`: to the front
        door's inbox; `on_ready(replica)`: a started replica serves (before the front door
        hears it)."""
        self._start_process, self.policy, self.post, self.on_ready = start, policy, post, on_ready
        self.processes: dict[int, ReplicaProcess] = {}
        self.sets: dict[int, list[str]] = {r: [] for r in indices}
        """Each replica's own overrides (the admin API's restart and add)."""
        self.in_a_row = {r: 0 for r in indices}
        self._then: dict[int, str] = {}
        """Replicas the admin API stops -> `stop`, `restart` or `remove` after."""
        self._starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshserve-replica-starter")
        """Replicas are started again from this one thread, which lives as long as the keeper:
        a replica gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG is per
        thread), and the thread that sees a replica end does end."""
        self._healing = False
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        for r in indices:
            self.processes[r] = start(r, self._on_exit, [])

    @property
    def replicas(self) -> list[ReplicaProcess]:
        with self._lock:
            return list(self.processes.values())

    def heal(self) -> None:
        """From now on (every replica served once), a replica that ends is restarted."""
        self._healing = True

    def stop_all(self, sig: int = signal.SIGTERM) -> None:
        """No more starts; every replica gets `sig` (SIGTERM: it drains)."""
        with self._lock:
            self._stopping.set()
        stop_replicas(self.replicas, sig)

    def wait(self, timeout: float) -> None:
        wait_stopped(self.replicas, timeout)

    # ------------------------------------------------------------------ ReplicaControl

    def manages(self, replica: int) -> bool:
        return replica in self.sets

    def refuses(self, op: str, replica: int | None) -> str | None:
        return None

    def stop(self, replica: int, then: str, sets: list[str] | None) -> None:
        with self._lock:
            self._then[replica] = then
            if sets is not None:
                self.sets[replica] = list(sets)
            process = self.processes.get(replica)
        if process is not None:
            stop_replicas([process])

    def start(self, replica: int, sets: list[str] | None) -> None:
        if sets is not None or replica not in self.sets:
            self.sets[replica] = list(sets or [])
        self.in_a_row[replica] = 0
        threading.Thread(target=self._launch, args=(replica,), daemon=True).start()

    def add(self, replica: int, sets: list[str]) -> None:
        self.start(replica, sets)

    # ------------------------------------------------------------------ on the replicas' threads

    def _on_exit(self, index: int, reason: str) -> None:
        """On the ended replica's own thread: tell the front door, and start it again if it may."""
        with self._lock:
            then = self._then.pop(index, None)
        if then is not None:
            if then == "restart" and not self._stopping.is_set():
                self.in_a_row[index] = 0
                self.post(ReplicaDown(index, "restarted by the admin API", expected=True, restart_in=0.0))
                self._launch(index)
            else:
                self.post(ReplicaDown(index, "stopped by the admin API" if then == "stop" else "removed",
                                      expected=True))
            return
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
        if not self._stopping.wait(delay):
            log.warning("replica %d: starting it again (restart %d in a row of at most %d)", index, attempt + 1,
                        self.policy.restart_limit)
            self._launch(index)

    def _launch(self, index: int) -> None:
        """Start replica `index` (from the starter thread) and tell the front door once it
        serves; if it ends first, its end comes to _on_exit on its own thread."""
        with self._lock:
            if self._stopping.is_set():
                return
            replica = self.processes[index] = self._starter.submit(self._start_process, index, self._on_exit,
                                                                   self.sets[index]).result()
        while not replica.ready.wait(0.2):
            if replica.process.poll() is not None or self._stopping.is_set():
                return
        self.on_ready(replica)
        self.post(ReplicaUp(index, replica.zmq))
