"""Worker threads that tokenize prompts, shortest first.

    pool = TokenizePool()
    future = pool.submit(len(text), tokenizer.encode, text)   # concurrent.futures.Future

A frontend's I/O thread or event loop never tokenizes: a long prompt takes seconds.
The tokenizer releases the GIL, so the threads run side by side; and the shortest job waiting
goes next, so a normal prompt never queues behind a client's burst of huge ones (at most
behind the ones already running).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable


FRONTEND_THREADS = 1
"""A frontend's pool: one thread, since a tokenizing thread takes a core from the model's
steps (on a small machine a burst of long prompts on two threads would take all its cores);
shortest first keeps short prompts ahead of long ones."""


class TokenizePool:
    def __init__(self, threads: int = FRONTEND_THREADS, name: str = "meshserve-tokenize"):
        self._jobs: list[tuple[int, int, Future, Callable, tuple]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, size: int, fn: Callable, *args: Any) -> Future:
        """Run fn(*args) on a worker; `size` orders the waiting jobs (smallest first, then FIFO)."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the tokenize pool is closed")
            heapq.heappush(self._jobs, (size, next(self._order), future, fn, args))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Cancel what waits; the running jobs finish on their daemon threads."""
        with self._cond:
            self._closed = True
            for _, _, future, _, _ in self._jobs:
                future.cancel()
            self._jobs.clear()
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                _, _, future, fn, args = heapq.heappop(self._jobs)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the submitter gets it
                future.set_exception(e)
