"""How much one bad request can hurt everyone else: the worst delay it adds to a concurrent
normal request's first token, per attack kind, against a real `meshserve serve`.

A prober sends normal requests back to back (HTTP, max_tokens=1, so a reply is the first
token) and a /health probe; each attack is sent while they run. Per kind it prints the
attack's status and time (medians of the rounds), the server's CPU-seconds for it (every
process of the deployment, from /proc, less what the probes cost without an attack), and the
worst probe latency during the attack minus the median with no attack (worst of the rounds).
Then it sends 2,000 bad requests and prints the deployment's RSS before and after. Writes
everything to results/bench_attacks.json.

    python scripts/bench_attacks.py [--set parallel.pipeline=2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import zmq

from meshserve.configs.cpu_features import cpu_features

from bench_http import Served, free_port

REPO = Path(__file__).resolve().parent.parent
MIB16 = 16 << 20
NORMAL = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}


def _flood(item: bytes, key: bytes = b"prompt", extra: bytes = b', "max_tokens": 1') -> bytes:
    n = (MIB16 - 64) // (len(item) + 1)
    return b'{"' + key + b'": [' + b",".join([item] * n) + b"]" + extra + b"}"


def http_attacks(max_model_len: int) -> dict[str, tuple[str, bytes]]:
    chars = 64 * max_model_len - 8
    return {
        "16 MiB of [[0],[0],...]": ("/v1/completions", _flood(b"[0]")),
        "550,000 empty chat messages": ("/v1/chat/completions",
                                        _flood(b'{"role":"user","content":""}', b"messages", b"")),
        f"31 prompts of {chars} spaces": ("/v1/completions",
                                          json.dumps({"prompt": [" " * chars] * 31, "max_tokens": 1}).encode()),
        f"31 prompts of {chars} letters": ("/v1/completions",
                                           json.dumps({"prompt": ["a" * chars] * 31, "max_tokens": 1}).encode()),
        "10 MB of token ids": ("/v1/completions", b'{"prompt": [' + b",".join([b"1"] * 5_000_000) + b"]}"),
        "top_k = 2**64": ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 1, "top_k": 18446744073709551616}'),
        "lone surrogate": ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}'),
    }


def zmq_attacks(max_model_len: int) -> dict[str, list[bytes]]:
    arrays = b"\xdd" + (MIB16 - 16).to_bytes(4, "big") + b"\x90" * (MIB16 - 16)
    spaces = " " * (64 * max_model_len - 8)
    return {
        "ZMQ: 16 MiB frame of 16.7 M empty arrays": [arrays],
        "ZMQ: 8 over-long prompts": [msgspec.msgpack.encode({"type": "generate", "request_id": f"long{i}",
                                                             "prompt": spaces}) for i in range(8)],
    }


class Deployment(Served):
    """`meshserve serve` with these overrides on free ports, and what its processes use."""

    def __init__(self, overrides: list[str], log: Path):
        self.http_port, self.zmq_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "meshserve.launcher.cli", "serve", "--set", f"server.http=127.0.0.1:{self.http_port}",
               "--set", f"server.zmq=tcp://127.0.0.1:{self.zmq_port}"]
        for o in overrides:
            cmd += ["--set", o]
        super().__init__("meshserve", cmd, log)
        self.url = f"http://127.0.0.1:{self.http_port}"

    def wait(self, timeout: float = 900) -> None:
        self.wait_http(self.url, timeout)

    def pids(self) -> list[int]:
        """The launcher and every process below it."""
        children: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d.name))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def cpu_seconds(self) -> float:
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for pid in self.pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError):
                pass
        return total

    def rss_bytes(self) -> int:
        total = 0
        for pid in self.pids():
            try:
                m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
                total += int(m.group(1)) * 1024 if m else 0
            except OSError:
                pass
        return total


class Prober:
    """Normal requests and /health, back to back, on threads of their own."""

    def __init__(self, url: str):
        self.url = url
        self.samples: list[tuple[float, float, str]] = []
        """(start, seconds, "ttft" | "health")."""
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(kind,), daemon=True) for kind in ("ttft", "health")]

    def __enter__(self) -> "Prober":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _run(self, kind: str) -> None:
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                if kind == "ttft":
                    resp = client.post(f"{self.url}/v1/completions", json=NORMAL)
                else:
                    resp = client.get(f"{self.url}/health")
                if resp.status_code == 200:
                    self.samples.append((start, time.monotonic() - start, kind))
                time.sleep(0.02)

    def worst(self, kind: str, since: float, until: float) -> float | None:
        """The slowest probe of `kind` that was in flight at any time in [since, until]."""
        hits = [s for start, s, k in self.samples if k == kind and start <= until and start + s >= since]
        return max(hits) if hits else None

    def median(self, kind: str) -> float:
        return statistics.median(s for _, s, k in self.samples if k == kind)


def send_zmq(address: str, frames: list[bytes], timeout: float = 300) -> list[str]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    codes = []
    try:
        for f in frames:
            sock.send(f)
        for _ in frames:
            if not sock.poll(int(timeout * 1000)):
                codes.append("no reply")
                break
            reply = msgspec.msgpack.decode(sock.recv())
            codes.append(reply.get("code", reply.get("type")) if isinstance(reply, dict) else "?")
    finally:
        sock.close()
        ctx.term()
    return codes


def measure(dep: Deployment, rounds: int, max_model_len: int) -> dict:
    attacks: dict[str, object] = {**http_attacks(max_model_len), **zmq_attacks(max_model_len)}
    results: dict[str, list[dict]] = {name: [] for name in attacks}
    with httpx.Client(timeout=600) as client, Prober(dep.url) as prober:
        cpu0 = dep.cpu_seconds()
        time.sleep(5)  # the baseline
        base_ttft, base_health = prober.median("ttft"), prober.median("health")
        base_cpu = (dep.cpu_seconds() - cpu0) / 5  # the probes' own work, per second
        for _ in range(rounds):
            for name, attack in attacks.items():
                time.sleep(1)
                cpu0, start = dep.cpu_seconds(), time.monotonic()
                if isinstance(attack, tuple):
                    path, body = attack
                    resp = client.post(f"{dep.url}{path}", content=body, headers={"content-type": "application/json"})
                    outcome = str(resp.status_code)
                else:
                    outcome = ",".join(sorted(set(send_zmq(f"tcp://127.0.0.1:{dep.zmq_port}", attack))))
                end = time.monotonic()
                time.sleep(0.5)  # the probe in flight at the end finishes
                worst_ttft, worst_health = prober.worst("ttft", start, end), prober.worst("health", start, end)
                results[name].append({
                    "outcome": outcome, "seconds": end - start,
                    "server_cpu_seconds": dep.cpu_seconds() - cpu0 - base_cpu * (time.monotonic() - start),
                    "worst_ttft_delay": None if worst_ttft is None else worst_ttft - base_ttft,
                    "worst_health_seconds": worst_health})
    return {"baseline_ttft_seconds": base_ttft, "baseline_health_seconds": base_health,
            "baseline_cpu_per_second": base_cpu, "attacks": results}


def rss_after_bad_requests(dep: Deployment, count: int) -> dict:
    bad = [b'{"prompt": "Hi", "top_k": 18446744073709551616}', b'{"prompt": "\\ud800"}', b'{"prompt": [true]}',
           b'{"prompt": "x", "n": 1000000}', b'{"prompt": [[0], [49152]]}', b"{" * 1000, b'{"prompt": "x" ']
    before = dep.rss_bytes()
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=60) as client:
        for i in range(count):
            resp = client.post(f"{dep.url}/v1/completions", content=bad[i % len(bad)],
                               headers={"content-type": "application/json"})
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
    time.sleep(1)
    return {"requests": count, "statuses": statuses, "rss_before_bytes": before, "rss_after_bytes": dep.rss_bytes()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], dest="overrides", help="config override KEY=VALUE")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bad-requests", type=int, default=2000)
    ap.add_argument("--max-model-len", type=int, default=8192, help="the served model's context (sizes the attacks)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_attacks.json")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    dep = Deployment(args.overrides, args.out.with_suffix(".log"))
    try:
        dep.wait()
        report = {"cpu": cpu_features().describe(), "overrides": args.overrides,
                  **measure(dep, args.rounds, args.max_model_len),
                  "rss": rss_after_bad_requests(dep, args.bad_requests), "alive": dep.proc.poll() is None}
    finally:
        dep.stop()
    print(f"{report['cpu']}; {' '.join(args.overrides) or 'default config'}")
    print(f"baseline first token {report['baseline_ttft_seconds'] * 1000:.0f} ms, /health "
          f"{report['baseline_health_seconds'] * 1000:.0f} ms (medians); 'cpu s' is the deployment's CPU time "
          f"for the attack beyond the probes' own; delays and /health are the worst of {args.rounds} rounds")
    print(f"{'attack':44s} {'outcome':>14s} {'took s':>7s} {'cpu s':>6s} {'worst TTFT delay s':>19s} "
          f"{'worst /health s':>16s}")
    for name, runs in report["attacks"].items():
        def med(key):
            values = [r[key] for r in runs if r[key] is not None]
            return f"{statistics.median(values):.2f}" if values else "-"

        def worst(key):
            values = [r[key] for r in runs if r[key] is not None]
            return f"{max(values):.2f}" if values else "-"

        outcome = "/".join(sorted({r["outcome"] for r in runs}))
        print(f"{name:44s} {outcome:>14s} {med('seconds'):>7s} {med('server_cpu_seconds'):>6s} "
              f"{worst('worst_ttft_delay'):>19s} {worst('worst_health_seconds'):>16s}")
    rss = report["rss"]
    print(f"RSS of the deployment: {rss['rss_before_bytes'] / 2**20:.0f} MiB before and "
          f"{rss['rss_after_bytes'] / 2**20:.0f} MiB after {rss['requests']} bad requests (statuses {rss['statuses']}); "
          f"server alive: {report['alive']}")
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
