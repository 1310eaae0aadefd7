"""A background compile that gives way to serving.

torch.compile runs in a thread of the serving process (engine/decode_path.py), and its
tracing and code generation are Python: they hold the GIL. Every torch op of an eager step
releases the GIL and must take it back, and a thread that wants it back waits for the
holder's switch interval (sys.getswitchinterval()): with the compile running, an eager decode
step that takes the GIL back a few hundred times is stretched many times over. The compile's C++
compiler processes and OpenMP threads compete for the same cores too.

So the compile thread runs only while serving is idle: a profile hook on its own Python calls
looks at the time of the last served step and, while steps are being served, sleeps
(releasing the GIL) until they stop. It also takes the lowest CPU priority (nice 19), which the
compiler processes and threads it starts inherit. A compile let run in short slices between
pauses, even rare ones, still cost eager steps much of their speed (each time it wakes it takes
the GIL from the serving thread); idle-only, they keep it. Under continuous load the compile
waits for the first quiet moment (scripts/bench_background_compile.py measures both).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import contextmanager

log = logging.getLogger(__name__)

IDLE_AFTER = 0.2
"""Seconds without a step after which serving counts as idle (the compile runs)."""
PAUSE = 0.1
"""Seconds the compile sleeps before it looks again whether serving is idle."""
CHECK_EVERY = 128
"""Python calls of the compile thread between two looks at the clock (the hook's cost)."""
LOWEST_PRIORITY = 19


class CompileThrottle:
    """`note_step()` from the serving thread at each step; `applied()` around the compile, in
    its thread. `clock` and `sleep` are time.monotonic and time.sleep (replaced in tests)."""

    def __init__(self, clock=time.monotonic, sleep=time.sleep):
        self.clock, self.sleep = clock, sleep
        self.last_step = float("-inf")
        self.calls = 0
        self.pauses = 0
        """Pauses taken, for the log line when the compile is done."""

    def note_step(self) -> None:
        self.last_step = self.clock()

    def serving(self, now: float) -> bool:
        return now - self.last_step < IDLE_AFTER

    def maybe_pause(self) -> None:
        """Sleep (releasing the GIL) until steps have stopped being served."""
        while self.serving(self.clock()):
            self.sleep(PAUSE)
            self.pauses += 1

    def _profile(self, frame, event, arg) -> None:
        self.calls += 1
        if self.calls % CHECK_EVERY == 0:
            self.maybe_pause()

    @contextmanager
    def applied(self):
        """The calling thread at the lowest CPU priority, and paused while steps are served."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        except (AttributeError, OSError) as e:  # not Linux: the pauses still apply
            log.debug("could not lower the compile thread's priority: %s", e)
        sys.setprofile(self._profile)
        try:
            yield self
        finally:
            sys.setprofile(None)
