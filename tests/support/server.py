"""A real `meshserve` process for end-to-end tests: start, wait for `ready`, stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from meshserve.launcher.network import free_port  # noqa: F401 (the tests import it from here)


EXACT = "model.dtype=float32"
"""The dtype the tests that compare with transformers' float32 (or a sharded run with an
unsharded one, token for token) pin: `model.dtype=auto` takes bfloat16 on CPUs with bf16 dot
products, whose rounding may flip a near-tie of greedy argmax."""


def http_url(ready_line: str, zmq_address: str | None = None) -> str:
    """The HTTP address a `ready` line announces (checking it also names `zmq_address`)."""
    m = re.search(r"http=(http://127\.0\.0\.1:\d+)", ready_line)
    assert m, f"the ready line has no HTTP address: {ready_line!r}"
    assert zmq_address is None or f"zmq={zmq_address}" in ready_line, ready_line
    return m.group(1)


class MeshserveProcess:
    """`cmd` is the command line after the python executable, e.g.
    ["-m", "meshserve.launcher.cli", "serve", "--set", ...]; or a full command with `raw=True`."""

    def __init__(self, cmd: list[str], log_dir: Path, name: str = "server", raw: bool = False, env=None):
        self.log = log_dir / f"{name}.log"
        self._log_file = open(self.log, "wb")
        full = cmd if raw else [sys.executable, *cmd]
        # its own session: the test can signal the whole group (launcher and ranks)
        self.proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=self._log_file, text=True, bufsize=1,
                                     start_new_session=True, env=env)
        self.stdout: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.stdout.append(line)
            if "ready" in line:
                self._ready.set()

    def wait_ready(self, timeout: float = 180.0) -> str:
        """Returns the ready line; fails with the log if the process exits or times out."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no ready line (exit code {self.proc.poll()}); log:\n{self.tail()}")
        return next(line for line in self.stdout if "ready" in line)

    def tail(self, n: int = 5000) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")[-n:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the launcher (as an operator would) and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL to the launcher's group and to every process below it (ranks run in
        sessions of their own)."""
        for pid in self.descendants():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log_file.close()

    def group_alive(self) -> bool:
        """Whether any process of the launcher's session is still running."""
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def descendants(self) -> list[int]:
        """Pids of every process below the launcher (the elastic agent starts each rank in a
        session of its own, so the launcher's process group does not cover them)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
        found, todo = [], [self.proc.pid]
        while todo:
            for child in children.get(todo.pop(), []):
                found.append(child)
                todo.append(child)
        return found


@contextmanager
def http_server(log_dir: Path, *settings: str, zmq: str | None = None, args: tuple[str, ...] = (),
                env: dict[str, str] | None = None, ready_timeout: float = 240.0
                ) -> Iterator[tuple[MeshserveProcess, str]]:
    """`meshserve serve` with HTTP on a free port, ZMQ on `zmq` (None: a free port), each of
    `settings` passed as `--set KEY=VALUE` (after EXACT's, which they may override) and `args` after them, in `env` (None: this
    process's); yields the process and the HTTP URL its ready line announces, and kills it
    on leaving."""
    zmq = zmq or f"tcp://127.0.0.1:{free_port()}"
    sets = [a for s in (EXACT, "server.http=127.0.0.1:0", f"server.zmq={zmq}", *settings) for a in ("--set", s)]
    proc = MeshserveProcess(["-m", "meshserve.launcher.cli", "serve", *sets, *args], log_dir, env=env)
    try:
        yield proc, http_url(proc.wait_ready(ready_timeout), zmq)
    finally:
        proc.kill()


@contextmanager
def openai_client(url: str, timeout: float, api_key: str = "unused"):
    """The real `openai` client against a server's HTTP `url`, without retries (a retry would
    hide a failed request)."""
    import openai

    with openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout) as c:
        yield c


def process_env(pid: int) -> dict[bytes, bytes] | None:
    """Process `pid`'s environment (None once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def alive(pids) -> list[int]:
    """Those of `pids` still running (not gone, not zombies)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out
