"""The one SIGTERM/SIGINT handler of a serving process (launcher/signals.py): the first
signal drains, a repeat within SAME_SIGNAL_S is the same stop, the next ends the requests
now, and a third exits at once. Signals are sent to this process and handled on its main
thread, as in a server."""

from __future__ import annotations

import os
import signal

import pytest

from meshserve.launcher import signals


@pytest.fixture
def restored_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_drain_then_now_then_exit(restored_handlers, monkeypatch):
    calls = []
    signals.on_stop_signals("draining", 30.0, drain=lambda: calls.append("drain"),
                            end_now=lambda: calls.append("now"))
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C by another path
    assert calls == ["drain"]
    monkeypatch.setattr(signals, "SAME_SIGNAL_S", 0.0)
    os.kill(os.getpid(), signal.SIGINT)
    assert calls == ["drain", "now"]
    with pytest.raises(SystemExit) as exited:
        os.kill(os.getpid(), signal.SIGTERM)
    assert exited.value.code == signals.EXIT_AT_ONCE and calls == ["drain", "now"]
