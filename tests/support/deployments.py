"""Several replicas behind one front door, for the end-to-end tests: start one, read its
metrics, find its processes."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from meshserve.client import Client
from support.server import EXACT, MeshserveProcess, free_port, http_url, process_env


def serve(tmp_path: Path, name: str, *sets: str) -> tuple[MeshserveProcess, str, str]:
    address = f"tcp://127.0.0.1:{free_port()}"
    server = MeshserveProcess(["-m", "meshserve.launcher.cli", "serve", "--set", EXACT, "--set", f"server.zmq={address}",
                               "--set", "server.http=127.0.0.1:0", "--set", "model.max_model_len=512",
                               *[a for s in sets for a in ("--set", s)]], tmp_path, name=name)
    line = server.wait_ready(300)
    return server, address, http_url(line, address)


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def samples(text: str, name: str) -> dict[tuple, float]:
    """{(label=value, ...): value} of metric `name` in a /metrics text."""
    out = {}
    for labels, value in re.findall(rf"^{name}\{{(.*?)\}} (\S+)$", text, re.M):
        out[tuple(sorted(labels.split(",")))] = float(value)
    return out


def replica_rank_pids(server: MeshserveProcess) -> dict[tuple[int, int], int]:
    """(replica, rank within it) -> pid, read from the ranks' environment."""
    pids = {}
    for pid in server.descendants():
        env = process_env(pid)
        if env is not None and b"RANK" in env and b"LOCAL_RANK" in env and b"MESHSERVE_REPLICA" in env:
            pids[int(env[b"MESHSERVE_REPLICA"]), int(env[b"RANK"])] = pid
    return pids


def replica_process(server: MeshserveProcess, replica: int) -> int:
    """The pid of replica `replica`'s own `meshserve serve` (its elastic agent)."""
    for pid in server.descendants():
        env = process_env(pid)
        if env is not None and env.get(b"MESHSERVE_REPLICA") == str(replica).encode() and b"RANK" not in env:
            return pid
    raise AssertionError(f"no process of replica {replica}")


def generate_concurrently(address: str, prompts: list[list[int]], max_tokens: int, timeout: float = 240) -> list[list[int]]:
    """Each prompt's greedy tokens, all requests in flight at once (a client each)."""
    results: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        with Client(address, timeout=timeout) as client:
            results[i] = client.generate(prompts[i], max_tokens=max_tokens, temperature=0).token_ids

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return [results.get(i) for i in range(len(prompts))]
