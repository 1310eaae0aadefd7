"""Failing fast and losing nothing, with real `meshserve serve` processes at tp = 2:

- a rank SIGKILLed during decode: every client gets an error within the failure timeout,
  the serve command exits non-zero naming the rank, no process of the group remains and
  no shared-memory segment is left;
- a rank SIGSTOPped: the driver gives up on it and exits first, and the serve command names
  the stopped rank as the one whose heartbeats stopped;
- the driver SIGKILLed: the other rank exits and removes the control plane's socket directory;
- the launcher SIGKILLed: its ranks, in sessions of their own, stop all the same;
- SIGTERM with requests in flight: they all finish, every rank exits, exit code 0;
- a burst of 10x the admission limit: refusals are immediate and explicit (`overloaded`),
  every admitted request completes; the tokens-waiting limit refuses too.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from meshserve.client import AsyncClient, Client, MeshserveError
from support.server import EXACT, MeshserveProcess, alive, free_port, process_env

FAILURE_TIMEOUT = 4.0
PROMPT = list(range(100, 120))


def _serve(tmp_path: Path, checkpoint: Path, name: str, *sets: str) -> tuple[MeshserveProcess, str]:
    address = f"tcp://127.0.0.1:{free_port()}"
    server = MeshserveProcess(["-m", "meshserve.launcher.cli", "serve", "--set", EXACT, "--set", f"model.path={checkpoint}",
                               "--set", f"server.zmq={address}", "--set", "server.http=127.0.0.1:0",
                               "--set", "model.max_model_len=512", "--set", "cache.memory=16MiB",
                               *[a for s in sets for a in ("--set", s)]], tmp_path, name=name)
    server.wait_ready()
    return server, address


def _rank_pids(server: MeshserveProcess) -> dict[int, int]:
    """Global rank -> pid of the serve command's rank processes (read from their environment)."""
    pids = {}
    for pid in server.descendants():
        env = process_env(pid)
        if env is not None and b"RANK" in env and b"LOCAL_RANK" in env:
            pids[int(env[b"RANK"])] = pid
    return pids


def _watch_health(url: str, seen: list[int], stop: threading.Event) -> None:
    """Poll /health until the server is gone; record every status."""
    while not stop.is_set():
        try:
            seen.append(httpx.get(f"{url}/health", timeout=2).status_code)
        except httpx.HTTPError:
            if seen:
                return
        time.sleep(0.05)


def _shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("meshserve-*")}


def _stream_until_error(address: str, started: threading.Event, outcome: dict) -> None:
    """One long greedy stream; records when and how it ended."""
    with Client(address, timeout=120) as client:
        try:
            for _ in client.generate(PROMPT, stream=True, max_tokens=480, ignore_eos=True, temperature=0):
                started.set()
            outcome["finished"] = time.monotonic()
        except MeshserveError as e:
            outcome["error"] = (e.code, str(e), time.monotonic())


@pytest.mark.slow
def test_rank_killed_during_decode_fails_requests_and_exits(tmp_path, tiny_checkpoints):
    shm_before = _shm_segments()
    server, address = _serve(tmp_path, tiny_checkpoints["llama"], "kill", "parallel.tensor=2",
                             f"cluster.failure_timeout={FAILURE_TIMEOUT}", "cluster.heartbeat_interval=0.5")
    try:
        pids = _rank_pids(server)
        assert set(pids) == {0, 1}, pids
        outcomes = [{} for _ in range(3)]
        started = [threading.Event() for _ in outcomes]
        threads = [threading.Thread(target=_stream_until_error, args=(address, s, o), daemon=True)
                   for s, o in zip(started, outcomes)]
        for t in threads:
            t.start()
        assert all(s.wait(60) for s in started), "no stream started"
        url = re.search(r"http=(http://\S+)", server.wait_ready()).group(1)
        health, stop = [], threading.Event()
        watcher = threading.Thread(target=_watch_health, args=(url, health, stop), daemon=True)
        watcher.start()
        deadline = time.monotonic() + 30
        while not health and time.monotonic() < deadline:  # its first answer comes before the kill
            time.sleep(0.01)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        for t in threads:
            t.join(FAILURE_TIMEOUT + 30)
        for o in outcomes:
            assert "error" in o, f"a request finished or hung although rank 1 died: {o}"
            code, message, at = o["error"]
            assert code == "unavailable", message
            assert at - killed_at < FAILURE_TIMEOUT + 10, f"the error took {at - killed_at:.1f} s"
        code = server.proc.wait(60)
        assert code != 0
        stop.set()
        watcher.join(5)
        assert health[0] == 200 and 503 in health, f"/health answered {health}"
        log = server.tail(20000)
        assert "rank 1 died first (killed by SIGKILL)" in log, log
        deadline = time.monotonic() + 10
        while alive(pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(pids.values()), "a rank outlived the serve command"
        assert not server.group_alive()
        assert _shm_segments() <= shm_before, "a shared-memory segment leaked"
    finally:
        server.kill()


@pytest.mark.slow
def test_driver_killed_while_idle_takes_the_other_ranks_down(tmp_path, tiny_checkpoints):
    server, _ = _serve(tmp_path, tiny_checkpoints["llama"], "kill0", "parallel.tensor=2",
                       f"cluster.failure_timeout={FAILURE_TIMEOUT}", "cluster.heartbeat_interval=0.5")
    try:
        pids = _rank_pids(server)
        found = re.search(r"control plane at ipc://(\S+)/control-pub", server.tail(20000))
        assert found and os.path.isdir(found.group(1)), server.tail()
        os.kill(pids[0], signal.SIGKILL)
        assert server.proc.wait(FAILURE_TIMEOUT + 30) != 0
        assert "rank 0 died first (killed by SIGKILL)" in server.tail(20000)
        assert not os.path.exists(found.group(1)), "rank 1 removes the dead driver's socket directory"
        deadline = time.monotonic() + 10
        while alive(pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(pids.values()), "rank 1 outlived the driver"
    finally:
        server.kill()


@pytest.mark.slow
def test_launcher_killed_outright_takes_its_ranks_down(tmp_path, tiny_checkpoints):
    """SIGKILL reaches the launcher alone (the agent starts each rank in a session of its
    own, and a killed launcher forwards nothing): its ranks still stop, and free the port."""
    server, address = _serve(tmp_path, tiny_checkpoints["llama"], "killlauncher", "parallel.tensor=2")
    try:
        pids = _rank_pids(server)
        assert sorted(pids) == [0, 1], server.tail()
        with Client(address, timeout=60) as client:
            assert len(client.generate(PROMPT, max_tokens=4, ignore_eos=True, temperature=0).token_ids) == 4
        os.kill(server.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 45
        while alive(pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(pids.values()), f"ranks outlived their launcher:\n{server.tail()}"
    finally:
        server.kill()


@pytest.mark.slow
def test_a_stopped_rank_is_named_as_the_one_that_hung(tmp_path, tiny_checkpoints):
    """SIGSTOP, not a death: rank 1 stops sending heartbeats, the driver gives up on it and
    exits first. The serve command's last line names rank 1 (from the reason the driver
    reported to the launcher), not the driver as the first to die."""
    server, _ = _serve(tmp_path, tiny_checkpoints["llama"], "stop1", "parallel.tensor=2",
                       f"cluster.failure_timeout={FAILURE_TIMEOUT}", "cluster.heartbeat_interval=0.5")
    try:
        pids = _rank_pids(server)
        os.kill(pids[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        deadline = stopped_at + FAILURE_TIMEOUT + 30
        while alive([pids[0]]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive([pids[0]]), "the driver did not give up on the stopped rank"
        assert time.monotonic() - stopped_at > FAILURE_TIMEOUT - 1
        os.kill(pids[1], signal.SIGCONT)  # it reads the driver's Abort and exits
        assert server.proc.wait(60) == 1
        log = server.tail(20000)
        assert (f"meshserve: rank 1 sent no heartbeat for {FAILURE_TIMEOUT:.0f} s (reported by rank 0, which then "
                f"exited: exit code 1); failed: rank 0 (exit code 1)") in log, log[-3000:]
        assert "died first" not in log
        deadline = time.monotonic() + 10
        while alive(pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(pids.values())
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.kill()


@pytest.mark.slow
def test_sigterm_at_tp2_finishes_requests_in_flight_and_exits_0(tmp_path, tiny_checkpoints):
    server, address = _serve(tmp_path, tiny_checkpoints["llama"], "sigterm", "parallel.tensor=2")
    try:
        pids = _rank_pids(server)
        assert set(pids) == {0, 1}, pids
        async def run() -> list:
            async with AsyncClient(address, timeout=120) as client:
                tasks = [asyncio.create_task(client.generate(PROMPT, max_tokens=200, ignore_eos=True, temperature=0))
                         for _ in range(4)]
                await asyncio.sleep(0.5)
                server.proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks)

        done = asyncio.run(run())
        assert [c.finish_reason for c in done] == ["length"] * 4
        assert all(len(c.token_ids) == 200 for c in done)
        assert server.proc.wait(60) == 0, server.tail()
        assert not alive(pids.values()) and not server.group_alive()
    finally:
        server.kill()


def test_burst_beyond_admission_is_refused_at_once(tmp_path, tiny_checkpoints):
    max_num_seqs, max_waiting = 2, 4
    server, address = _serve(tmp_path, tiny_checkpoints["llama"], "burst", f"scheduler.max_num_seqs={max_num_seqs}",
                             f"scheduler.max_waiting={max_waiting}", "scheduler.max_waiting_tokens=100")
    try:
        async def one(client: AsyncClient, prompt: list[int], max_tokens: int):
            sent = time.monotonic()
            try:
                c = await client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0)
                return "done", c, time.monotonic() - sent
            except MeshserveError as e:
                return e.code, str(e), time.monotonic() - sent

        async def run():
            async with AsyncClient(address, timeout=120) as client:
                limit = max_num_seqs + max_waiting
                burst = await asyncio.gather(*[one(client, PROMPT, 64) for _ in range(10 * limit)])
                # the token limit: two long requests run, then 60-token prompts wait until 100 tokens wait
                runners = [asyncio.create_task(one(client, PROMPT, 480)) for _ in range(max_num_seqs)]
                await asyncio.sleep(0.1)
                long_prompts = await asyncio.gather(*[one(client, list(range(200, 260)), 8) for _ in range(3)])
                return burst, await asyncio.gather(*runners), long_prompts

        burst, runners, long_prompts = asyncio.run(run())
        done = [r for r in burst if r[0] == "done"]
        refused = [r for r in burst if r[0] != "done"]
        assert {r[0] for r in refused} == {"overloaded"}, refused[:3]
        assert len(done) >= max_waiting
        assert all(len(c.token_ids) == 64 and c.finish_reason == "length" for _, c, _ in done)
        assert max(t for _, _, t in refused) < 5.0, "a refusal waited"
        assert "max_waiting=4" in refused[0][1]
        assert all(r[0] == "done" for r in runners)
        assert [r[0] for r in long_prompts].count("overloaded") == 2, long_prompts
        assert "max_waiting_tokens=100" in next(r[1] for r in long_prompts if r[0] == "overloaded")
        with Client(address, timeout=60) as client:
            assert client.generate(PROMPT, max_tokens=4, temperature=0).finish_reason == "length"
        assert server.stop() == 0, server.tail()
    finally:
        server.kill()
