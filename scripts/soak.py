"""Soak: minutes of mixed load against a real `meshserve serve`, then what it served, the
errors by kind, and every rank's resident memory over the run.

The load (--workers concurrent loops, each picking at random): ZMQ requests streamed and
not, ZMQ streams aborted after a few deltas, OpenAI HTTP completions and chat streams, HTTP
streams whose client disconnects early, and bad requests of both kinds (which must get
their error and nothing else). Prompts are random words of 5-400 tokens; outputs 1-96
tokens. Resident memory (VmRSS) of each rank is read every --sample-every seconds: at
ready, after the warm-up minute, and at the end; the growth after warm-up is the figure.
Finally SIGTERM: the server must drain and exit 0.

    python scripts/soak.py [--minutes 10] [--config configs/smollm2-tp3.yaml] [--workers 8]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from meshserve.client import AsyncClient, MeshserveError

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is was for on that with as by at from his her an which or be are this have had not "
         "river mountain engine token paper garden window signal market number silver planet quiet letter").split()


class Server:
    """`meshserve serve` in a session of its own; its ranks found through /proc."""

    def __init__(self, config: str, overrides: list[str], log: Path):
        self.log = open(log, "w")
        cmd = [sys.executable, "-m", "meshserve.launcher.cli", "serve", config, "--set", "server.http=127.0.0.1:0",
               "--set", "server.zmq=tcp://127.0.0.1:0", *[a for o in overrides for a in ("--set", o)]]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        self.ready = ""
        for line in self.proc.stdout:
            if "ready" in line:
                self.ready = line
                break
        if not self.ready:
            raise RuntimeError(f"the server exited with {self.proc.wait()}; see {log}")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.zmq = re.search(r"zmq=(\S+)", self.ready).group(1)
        self.http = re.search(r"http=(\S+)", self.ready).group(1)
        self.ranks = self._rank_pids()

    def _rank_pids(self) -> dict[int, int]:
        children = collections.defaultdict(list)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
                children[ppid].append(int(entry.name))
        ranks, todo = {}, [self.proc.pid]
        while todo:
            pid = todo.pop()
            todo.extend(children[pid])
            try:
                env = dict(i.split(b"=", 1) for i in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in i)
            except OSError:
                continue
            if b"RANK" in env and b"LOCAL_RANK" in env:
                ranks[int(env[b"RANK"])] = pid
        return ranks or {0: self.proc.pid}  # world size 1: the driver is the serve process

    def rss_mib(self) -> dict[int, float]:
        out = {}
        for rank, pid in sorted(self.ranks.items()):
            status = Path(f"/proc/{pid}/status").read_text()
            out[rank] = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
        return out


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Load:
    def __init__(self, server: Server, model: str, seed: int):
        self.server, self.model = server, model
        self.rng = random.Random(seed)
        self.counts: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        """Unexpected failures by kind: each one is a bug."""
        self.tokens = 0

    async def zmq_request(self, client: AsyncClient) -> None:
        prompt = words(self.rng, self.rng.randint(5, 400))
        max_tokens = self.rng.randint(1, 96)
        if self.rng.random() < 0.5:
            c = await client.generate(prompt, max_tokens=max_tokens, temperature=self.rng.choice([0, 0.8]))
            self.tokens += len(c.token_ids)
            self.counts["zmq completed"] += 1
            return
        rid = f"soak-{self.rng.getrandbits(64):x}"
        abort_after = self.rng.choice([None, 1, 3, 8])
        seen = 0
        async for delta in await client.generate(prompt, stream=True, request_id=rid, max_tokens=max_tokens):
            seen += len(delta.token_ids)
            if abort_after is not None and seen >= abort_after and delta.finish_reason is None:
                await client.abort(rid)
                abort_after = None
            if delta.finish_reason is not None:
                self.counts[f"zmq stream {delta.finish_reason}"] += 1
        self.tokens += seen

    async def zmq_bad(self, client: AsyncClient) -> None:
        bad = self.rng.choice([dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=2.0)])
        try:
            await client.generate("hello", **bad)
            self.errors["zmq bad request accepted"] += 1
        except MeshserveError as e:
            self.counts[f"zmq refused ({e.code})"] += 1

    async def http_request(self, http: httpx.AsyncClient) -> None:
        chat = self.rng.random() < 0.5
        body = {"model": self.model, "max_tokens": self.rng.randint(1, 96), "stream": True,
                "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": words(self.rng, self.rng.randint(5, 300))}]
        else:
            body["prompt"] = words(self.rng, self.rng.randint(5, 400))
        path = "/v1/chat/completions" if chat else "/v1/completions"
        leave_after = self.rng.choice([None, None, 2, 5])
        chunks = 0
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                self.errors[f"http {r.status_code}"] += 1
                return
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        self.counts["http disconnected early"] += 1
                        return
        self.counts["http stream completed"] += 1

    async def http_bad(self, http: httpx.AsyncClient) -> None:
        kind = self.rng.choice(["json", "type", "value"])
        content = {"json": b"{not json", "type": json.dumps({"model": self.model, "prompt": 5}).encode(),
                   "value": json.dumps({"model": self.model, "prompt": "x", "max_tokens": -3}).encode()}[kind]
        r = await http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        if r.status_code == 400 and "error" in r.json():
            self.counts["http refused (400)"] += 1
        else:
            self.errors[f"http bad {kind} -> {r.status_code}"] += 1

    async def worker(self, client: AsyncClient, http: httpx.AsyncClient, until: float) -> None:
        actions = [(self.zmq_request, 0.4), (self.http_request, 0.4), (self.zmq_bad, 0.1), (self.http_bad, 0.1)]
        while time.monotonic() < until:
            action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
            try:
                await action(client if action in (self.zmq_request, self.zmq_bad) else http)
            except MeshserveError as e:
                self.errors[f"zmq {e.code}"] += 1
            except httpx.HTTPError as e:
                self.errors[f"http {type(e).__name__}"] += 1


async def run_load(server: Server, args, samples: list) -> Load:
    load = Load(server, args.model_name, args.seed)
    until = time.monotonic() + args.minutes * 60

    async def sample():
        start = time.monotonic()
        while time.monotonic() < until:
            samples.append((round(time.monotonic() - start, 1), server.rss_mib()))
            await asyncio.sleep(args.sample_every)

    async with AsyncClient(server.zmq, timeout=300) as client, \
            httpx.AsyncClient(base_url=server.http, timeout=300) as http:
        sampler = asyncio.create_task(sample())
        await asyncio.gather(*[load.worker(client, http, until) for _ in range(args.workers)])
        await sampler
    return load


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--config", default=str(REPO / "configs" / "smollm2-tp3.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--sample-every", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of load before the baseline RSS sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "results" / "soak.json"))
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    server = Server(args.config, args.overrides, out.with_suffix(".log"))
    try:
        args.model_name = httpx.get(f"{server.http}/v1/models").json()["data"][0]["id"]
        at_ready = server.rss_mib()
        samples: list = []
        started = time.monotonic()
        load = asyncio.run(run_load(server, args, samples))
        elapsed = time.monotonic() - started
        at_end = server.rss_mib()
        server.proc.send_signal(signal.SIGTERM)
        exit_code = server.proc.wait(120)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    baseline = next((rss for t, rss in samples if t >= args.warmup), samples[0][1] if samples else at_ready)
    served = sum(v for k, v in load.counts.items() if "refused" not in k)
    print(f"soak: {elapsed / 60:.1f} min, {args.workers} workers, {args.config} {' '.join(args.overrides)}")
    print(f"requests served: {served} ({load.tokens} tokens generated); outcomes:")
    for k, v in sorted(load.counts.items()):
        print(f"  {k:<32}{v:>7}")
    print(f"unexpected errors: {sum(load.errors.values())}" + "".join(f"\n  {k:<32}{v:>7}" for k, v in
                                                                      sorted(load.errors.items())))
    print(f"{'rank':<6}{'RSS at ready':>14}{f'after {args.warmup:.0f} s':>14}{'at end':>10}{'growth':>10}  (MiB)")
    for rank in sorted(at_end):
        print(f"{rank:<6}{at_ready[rank]:>14.0f}{baseline[rank]:>14.0f}{at_end[rank]:>10.0f}"
              f"{at_end[rank] - baseline[rank]:>+10.0f}")
    print(f"SIGTERM: exit code {exit_code}")
    out.write_text(json.dumps({"minutes": elapsed / 60, "workers": args.workers, "config": args.config,
                               "overrides": args.overrides, "served": served, "tokens": load.tokens,
                               "outcomes": dict(load.counts), "unexpected_errors": dict(load.errors),
                               "rss_mib": {"at_ready": at_ready, "after_warmup": baseline, "at_end": at_end},
                               "rss_samples": samples, "exit_code": exit_code}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if exit_code == 0 and not load.errors else 1


if __name__ == "__main__":
    sys.exit(main())
