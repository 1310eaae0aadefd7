"""The background compile's throttle (engine/compile_throttle.py): the compile thread sleeps
while steps are being served, looked at from its own Python calls, at the lowest CPU
priority; idle, the compile runs freely."""

from __future__ import annotations

import os
import sys
import threading

from meshserve.engine import compile_throttle
from meshserve.engine.compile_throttle import CompileThrottle


class FakeTime:
    """A clock that moves `tick` seconds at each reading, and by each sleep."""

    def __init__(self, tick: float = 0.0):
        self.now, self.tick, self.slept = 100.0, tick, []

    def clock(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_pauses_while_steps_are_served_and_never_when_idle():
    t = FakeTime()
    throttle = CompileThrottle(clock=t.clock, sleep=t.sleep)
    throttle.maybe_pause()
    assert t.slept == []  # no step yet
    throttle.note_step()
    throttle.maybe_pause()  # serving: sleeps until no step came for IDLE_AFTER
    waited = sum(t.slept)
    assert compile_throttle.IDLE_AFTER <= waited < compile_throttle.IDLE_AFTER + compile_throttle.PAUSE + 1e-9
    assert throttle.pauses == len(t.slept) > 0
    before = len(t.slept)
    for _ in range(10):  # idle
        throttle.maybe_pause()
    assert len(t.slept) == before


def test_applied_hooks_the_compile_threads_calls_at_the_lowest_priority():
    t = FakeTime(tick=1e-6)
    throttle = CompileThrottle(clock=t.clock, sleep=t.sleep)
    seen = {}

    def compile_like(serving: bool) -> None:
        with throttle.applied():
            for _ in range(20 * compile_throttle.CHECK_EVERY):
                if serving:
                    throttle.note_step()
                len([])  # a Python-level call the hook sees
            seen["priority"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen["hook_after"] = sys.getprofile()

    for serving in (False, True):
        worker = threading.Thread(target=compile_like, args=(serving,))
        worker.start()
        worker.join()
        if not serving:
            assert throttle.pauses == 0
    assert throttle.pauses >= 10  # at each look while steps came
    assert seen == {"priority": compile_throttle.LOWEST_PRIORITY, "hook_after": None}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != compile_throttle.LOWEST_PRIORITY
