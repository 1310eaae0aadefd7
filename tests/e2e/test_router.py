"""`meshserve router` with replicas its launchers start (router.join), across two network
namespaces standing in for two nodes: the router on node 0; replicas started by torchrun
on node 0 and on node 1 and by mpiexec on node 0 join it over the CURVE-encrypted
registration socket (the config's secret), are reached at their nodes' addresses, and
serve greedy tokens equal to transformers'. The rank of node 1's replica SIGKILLed: the
router drops it when its heartbeat stops, torchrun starts it again (--max-restarts), and
it joins again under its name and serves. A process without the secret cannot join."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from support.deployments import samples
from support.multinode import CLI, SECRET, tool, write_config
from support.reference import hf_greedy, hf_model
from support.server import MeshserveProcess, free_port


PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 320)), [5, 6, 7, 8, 9], list(range(1000, 1012)),
           [9, 99, 999, 9999], list(range(2000, 2016))]
MAX_TOKENS = 8
CLIENT = """
import json, sys, threading
from meshserve.client import Client
prompts, results = json.loads(sys.argv[2]), {}
def ask(i):
    with Client(sys.argv[1], timeout=120, secret=sys.argv[4]) as client:
        results[i] = client.generate(prompts[i], max_tokens=int(sys.argv[3]), temperature=0).token_ids
threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps([results[i] for i in range(len(prompts))]))
"""
INTRUDER = """
import sys, time, zmq
from meshserve.comm.auth import FrameAuth
from meshserve.comm.curve import make_curve_client
from meshserve.comm.membership import Join
import msgspec
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
make_curve_client(s, "not-the-secret-" * 3, "join")
s.connect(sys.argv[1])
s.send(FrameAuth("not-the-secret-" * 3, "join").seal(msgspec.msgpack.encode(
    Join("intruder", "tcp://10.77.0.2:1", None, sys.argv[2], 1, 1, 1))), zmq.NOBLOCK) if s.poll(0, zmq.POLLOUT) else None
print("answered" if s.poll(3000) else "silent")
s.close(linger=0)
ctx.term()
"""


def router_health(nodes, url: str) -> dict:
    out = subprocess.run(nodes.cmd(0, ["curl", "-s", f"{url}/health"]), capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)


def tokens(nodes, address: str) -> list[list[int]]:
    out = subprocess.run(nodes.cmd(0, [sys.executable, "-c", CLIENT, address, json.dumps(PROMPTS), str(MAX_TOKENS),
                                       SECRET]), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def wait_for(nodes, url: str, check, what: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = router_health(nodes, url)
        if check(health):
            return health
        assert time.monotonic() < deadline, f"{what}: {health}"
        time.sleep(0.1)


@pytest.mark.slow
def test_replicas_of_torchrun_and_mpiexec_on_two_nodes_join_one_router(nodes, tmp_path, tiny_checkpoints):
    model = tiny_checkpoints["llama"]
    reference = hf_model(model)
    want = [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
    node0 = nodes.addresses[0]
    listen = f"tcp://{node0}:{free_port()}"
    cfg = write_config(tmp_path, model, "replica.yaml", tensor=1, zmq="tcp://0.0.0.0:5555", secret=SECRET,
                       cluster={"interface": nodes.interface})
    joins = ["--set", f"router.join={listen}", "--set", "router.heartbeat_interval=0.3"]
    http = f"{node0}:{free_port()}"
    router = MeshserveProcess(nodes.cmd(0, [*CLI, "router", str(cfg), "--set", f"server.zmq=tcp://{node0}:5550",
                                            "--set", f"server.http={http}", "--set", f"router.listen={listen}",
                                            "--set", "router.heartbeat_interval=0.3",
                                            "--set", "router.heartbeat_timeout=1.5"]), tmp_path, name="router", raw=True)
    procs = []
    try:
        assert f"listen={listen}" in router.wait_ready(120)
        url = f"http://{http}"

        def torchrun(node: int, port: int) -> MeshserveProcess:
            return MeshserveProcess(nodes.cmd(node, [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "--max-restarts", "1", "--monitor-interval", "0.2", *CLI[1:], "worker", str(cfg),
                "--set", f"server.zmq=tcp://0.0.0.0:{port}", *joins]), tmp_path, name=f"torchrun{node}", raw=True)

        procs = [torchrun(0, 5561), torchrun(1, 5562),
                 MeshserveProcess(nodes.cmd(0, [tool("mpiexec"), "-n", "1", *CLI, "worker", str(cfg), "--set",
                                                "server.zmq=tcp://0.0.0.0:5563", *joins]), tmp_path, name="mpi",
                                  raw=True)]
        health = wait_for(nodes, url, lambda h: h["replicas"]["serving"] == 3, "three replicas join", 240)
        assert health["status"] == "ok"
        log = router.tail(1 << 20)
        for address in (f"{node0}:5561", f"{nodes.addresses[1]}:5562", f"{node0}:5563"):
            assert re.search(rf"replica \d joined: '{re.escape('tcp://' + address)}'", log), log[-3000:]
        assert tokens(nodes, f"tcp://{node0}:5550") == want
        metrics = subprocess.run(nodes.cmd(0, ["curl", "-s", f"{url}/metrics"]), capture_output=True, text=True,
                                 timeout=30).stdout
        routed = samples(metrics, "meshserve_router_requests_total")
        assert {r for r in "012" if any(f'replica="{r}"' in k for k in routed)} == set("012"), routed

        intruder = subprocess.run(nodes.cmd(1, [sys.executable, "-c", INTRUDER, listen, str(model)]),
                                  capture_output=True, text=True, timeout=60)
        assert intruder.stdout.strip() == "silent", intruder.stderr[-2000:]
        assert "intruder" not in router.tail(1 << 20)

        node1 = re.search(r"replica (\d) joined: 'tcp://10\.77\.0\.2:5562'", router.tail(1 << 20)).group(1)
        rank = next(pid for pid in procs[1].descendants()
                    if b"worker" in open(f"/proc/{pid}/cmdline", "rb").read())
        killed = time.monotonic()
        subprocess.run(["kill", "-9", str(rank)], check=True)
        wait_for(nodes, url, lambda h: h["replicas"]["serving"] == 2, "the killed replica dropped", 30)
        health = wait_for(nodes, url, lambda h: h["replicas"]["serving"] == 3, "it joins again", 120)
        each = health["replicas"]["each"][int(node1)]
        assert each == {"replica": int(node1), "state": "serving", "restarts": 1}, health
        assert "its heartbeat stopped for 1.5 s" in router.tail(1 << 20)
        assert time.monotonic() - killed < 120
        assert tokens(nodes, f"tcp://{node0}:5550") == want
        assert router.stop() == 0, router.tail()
        for p in procs:  # the replicas outlive their router; their launchers stop them
            p.stop(signal.SIGTERM)
    finally:
        router.kill()
        for p in procs:
            p.kill()
