"""What a replica's death costs its streams, and how long the deployment takes to heal: a
dp=2 `meshserve serve` (SmolLM2 by default), --streams greedy streams in flight (fresh
random prompts each round), then SIGKILL of one replica's rank (replica 0 and 1 in turn;
with one rank per replica its process is its rank).

Per round:
- time to the next token after the kill, per stream: the streams of the killed replica
  move to the other with their output (the front door's migration), which computes their
  prompt and output before it streams on. The streams that moved are the round's
  meshserve_router_migrations_total count of those with the longest wait (the front door
  does not tell a client it moved); the others' wait is a step of the surviving replica;
- restart time: from the kill until /health shows the replica serving again (its process
  started again after router.restart_backoff, the model loaded, the ready line);
- the inter-token time of the same streams before the kill, for scale.

Prints p50/p99 over all rounds and writes every figure to --out/summary.json.

    python scripts/bench_migration.py [--rounds 6] [--streams 16] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench_common import random_prompts
from bench_http import meshserve_server
from meshserve.client import Client, MeshserveError
from meshserve.configs.cpu_features import cpu_features

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def replica_rank(server_pid: int, replica: int) -> int:
    """The pid of replica `replica`'s rank 0: its `meshserve serve` with one rank, else the
    process of its rank 0."""
    found = {}
    for pid in descendants(server_pid):
        try:
            env = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if
                       b"=" in item)
        except OSError:
            continue
        if env.get(b"MESHSERVE_REPLICA") == str(replica).encode():
            found["rank" if env.get(b"RANK") == b"0" else "serve" if b"RANK" not in env else "other"] = pid
    return found.get("rank", found.get("serve"))


def metric(url: str, name: str, replica: int) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf'^{name}\{{replica="{replica}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def stream_all(address: str, prompts: list[list[int]], max_tokens: int, started: threading.Event, min_tokens: int
               ) -> list[dict]:
    """Every prompt streamed at once, a client each: per stream the arrival time of each delta."""
    outcomes = [{"times": [], "tokens": 0} for _ in prompts]
    ready = [threading.Event() for _ in prompts]

    def one(i: int) -> None:
        with Client(address, timeout=300) as client:
            try:
                for delta in client.generate(prompts[i], stream=True, max_tokens=max_tokens, ignore_eos=True,
                                             temperature=0):
                    outcomes[i]["times"].append(time.monotonic())
                    outcomes[i]["tokens"] += len(delta.token_ids)
                    if outcomes[i]["tokens"] >= min_tokens:
                        ready[i].set()
            except MeshserveError as e:
                outcomes[i]["error"] = f"{e.code}: {e}"
                ready[i].set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for r in ready:
        r.wait(300)
    started.set()
    for t in threads:
        t.join(600)
    return outcomes


def one_round(served, address: str, url: str, replica: int, args, seed: int) -> dict:
    prompts = random_prompts(args.streams, args.input_len, seed=seed)
    moved_before = metric(url, "meshserve_router_migrations_total", replica)
    restarts_before = metric(url, "meshserve_replica_restarts_total", replica)
    started = threading.Event()
    result: dict = {}

    def kill() -> None:
        started.wait(600)
        pid = replica_rank(served.proc.pid, replica)
        result["killed_at"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while True:  # until the replica serves again
            try:
                each = httpx.get(f"{url}/health", timeout=5).json()["replicas"]["each"][replica]
                if each["state"] == "serving" and each["restarts"] > restarts_before:
                    result["restart_s"] = time.monotonic() - result["killed_at"]
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - result["killed_at"] > 300:
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    outcomes = stream_all(address, prompts, args.output_len, started, args.kill_after)
    killer.join(400)
    killed = result["killed_at"]
    errors = [o["error"] for o in outcomes if "error" in o]
    waits = sorted((next((t for t in o["times"] if t > killed), None) or float("inf")) - killed
                   for o in outcomes if "error" not in o)
    moved = int(metric(url, "meshserve_router_migrations_total", replica) - moved_before)
    before = [b - a for o in outcomes for a, b in zip(o["times"], o["times"][1:]) if b < killed]
    return {"replica": replica, "errors": errors, "moved": moved, "moved_waits_s": waits[len(waits) - moved:],
            "other_waits_s": waits[:len(waits) - moved], "restart_s": result.get("restart_s"),
            "itl_before_s": statistics.median(before) if before else None,
            "tokens": [o["tokens"] for o in outcomes]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kill-after", type=int, default=16, help="tokens every stream has before the kill")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_migration")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    served = meshserve_server("dp2", ["parallel.data=2", *args.sets], args.out / "server.log")
    rounds = []
    try:
        url = served.wait_http(None)
        address = next(re.search(r"zmq=(\S+)", line).group(1) for line in served.lines if "ready" in line)
        for r in range(args.rounds):
            print(f"# round {r}: killing replica {r % 2}", file=sys.stderr, flush=True)
            rounds.append(one_round(served, address, url, r % 2, args, seed=1000 + r))
            print(json.dumps({k: v for k, v in rounds[-1].items() if k != "tokens"}), file=sys.stderr, flush=True)
    finally:
        served.stop()
    moved = [w for r in rounds for w in r["moved_waits_s"]]
    other = [w for r in rounds for w in r["other_waits_s"]]
    restarts = [r["restart_s"] for r in rounds if r["restart_s"] is not None]
    itl = [r["itl_before_s"] for r in rounds if r["itl_before_s"] is not None]
    summary = {
        "machine": {"cpu_isa": [f for f in ("avx512f", "amx_bf16") if f in cpu_features().flags],
                    "cores": os.cpu_count()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "errors": sum(len(r["errors"]) for r in rounds),
        "incomplete_streams": sum(t != args.output_len for r in rounds for t in r["tokens"]),
        "moved_streams": len(moved),
        "moved_next_token_s": {"p50": percentile(moved, 50), "p99": percentile(moved, 99)} if moved else None,
        "other_next_token_s": {"p50": percentile(other, 50), "p99": percentile(other, 99)} if other else None,
        "itl_before_kill_s": statistics.median(itl) if itl else None,
        "restart_s": {"p50": percentile(restarts, 50), "max": max(restarts), "all": restarts} if restarts else None,
        "rounds": rounds,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{args.rounds} rounds, {args.streams} streams of {args.output_len} tokens, kill after {args.kill_after}; "
          f"isa {summary['machine']['cpu_isa']}, {summary['machine']['cores']} cores")
    print(f"errors {summary['errors']}, incomplete streams {summary['incomplete_streams']}, "
          f"streams moved {len(moved)}")
    if moved:
        print(f"next token after the kill, moved streams:   p50 {percentile(moved, 50) * 1000:8.0f} ms   "
              f"p99 {percentile(moved, 99) * 1000:8.0f} ms")
    if other:
        print(f"next token after the kill, other streams:   p50 {percentile(other, 50) * 1000:8.0f} ms   "
              f"p99 {percentile(other, 99) * 1000:8.0f} ms")
    if itl:
        print(f"inter-token time before the kill (median):  {statistics.median(itl) * 1000:8.0f} ms")
    if restarts:
        print(f"restart (kill -> serving again):            p50 {percentile(restarts, 50):8.1f} s    "
              f"max {max(restarts):8.1f} s")
    print(f"wrote {args.out / 'summary.json'}")
    return 0 if not summary["errors"] and not summary["incomplete_streams"] else 1


if __name__ == "__main__":
    sys.exit(main())
