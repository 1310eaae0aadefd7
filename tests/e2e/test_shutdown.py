"""Stopping a deployment the ways operators do, with real processes and a real stream in
flight: Ctrl-C reaching every process at once (the terminal's way) drains the stream to
its end, /health turns 503 before a new request is refused, and the log says so in our
words (no "death signal" warnings); a second Ctrl-C ends the requests at once, each with a
finish_reason and [DONE]."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from support.server import EXACT, MeshserveProcess, free_port, http_url

TIMEOUT = 120


class Stream:
    """One streamed completion read on a thread of its own."""

    def __init__(self, url: str, body: dict):
        self.events: list[dict] = []
        self.done = False
        """[DONE] arrived."""
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=TIMEOUT) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def wait_chunks(self, n: int) -> None:
        deadline = time.monotonic() + TIMEOUT
        while len(self.events) < n and self.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.events) >= n, self.error

    def join(self) -> str:
        """The stream's finish_reason, once it ended properly."""
        self._thread.join(TIMEOUT)
        assert self.error is None and not self._thread.is_alive(), self.error
        assert self.done, "no [DONE]"
        reasons = [e["choices"][0]["finish_reason"] for e in self.events if e.get("choices")]
        assert reasons and all(r is None for r in reasons[:-1]), reasons
        return reasons[-1]


def interrupt_everyone(server: MeshserveProcess) -> None:
    """SIGINT to the launcher and every process below it at once, as Ctrl-C in a terminal
    reaches the whole foreground job."""
    for pid in [server.proc.pid, *server.descendants()]:
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass


def serve(tmp_path, name: str, *args: str) -> tuple[MeshserveProcess, str]:
    server = MeshserveProcess(["-m", "meshserve.launcher.cli", "serve", "--set", EXACT, *args, "--host", "127.0.0.1", "--port", "0",
                               "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}"], tmp_path, name=name,
                              env=os.environ | {"OMP_NUM_THREADS": "1"})
    return server, http_url(server.wait_ready(240))


@pytest.mark.slow
def test_ctrl_c_drains_the_streams_and_health_turns_first(tmp_path, tiny_checkpoints):
    server, url = serve(tmp_path, "tp2", "-m", str(tiny_checkpoints["llama"]), "-tp", "2", "--max-model-len", "512",
                        "--set", "cache.memory=16MiB")
    try:
        stream = Stream(url, {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True})
        stream.wait_chunks(2)
        interrupt_everyone(server)
        seen = []  # (health status, completion status) until a completion is refused
        while not seen or seen[-1][1] == 200:
            health = httpx.get(f"{url}/health", timeout=30).status_code
            late = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 1}, timeout=30)
            seen.append((health, late.status_code))
        assert seen[-1] == (503, 503), seen
        assert all(h == 503 for h, c in seen if c == 503), f"/health said 200 while requests were refused: {seen}"
        assert stream.join() == "length", "the request in flight drained to its end"
        assert server.proc.wait(TIMEOUT) == 0, server.tail()
        log = server.tail(1 << 20)
        assert "death signal" not in log and "closing signal" not in log, log[-3000:]
        assert "SIGINT: draining" in log and "the driver drains its requests, then the ranks stop" in log
    finally:
        server.kill()


@pytest.mark.slow
def test_a_second_ctrl_c_ends_every_stream_now_and_properly(tmp_path):
    server, url = serve(tmp_path, "one", "--max-model-len", "1024")
    try:
        streams = [Stream(url, {"prompt": f"Story {i}:", "max_tokens": 900, "ignore_eos": True}) for i in range(2)]
        for s in streams:
            s.wait_chunks(2)
        interrupt_everyone(server)
        time.sleep(1.5)  # past the window in which a second signal is the same Ctrl-C
        interrupt_everyone(server)
        assert [s.join() for s in streams] == ["abort", "abort"]
        assert server.proc.wait(TIMEOUT) == 1, server.tail()
        assert "second SIGINT: ending the requests in flight now" in server.tail(1 << 20)
    finally:
        server.kill()
