"""Across nodes, through the launchers clusters use: two network namespaces stand in for two
nodes (tp = 2 inside each, pp = 2 across them) started by `meshserve serve --node-rank K` and
by torchrun, and two replicas (parallel.data=2), one per node, behind node 0's front door;
`mpiexec -n 4` with mpi4py; the deepspeed launcher; disaggregated prefill on node 0 and
decode on node 1, the KV crossing between them; node 1 starting its failed replica again.
Greedy tokens equal one rank's.
Across the namespaces the control plane is CURVE-encrypted (the configs carry a secret): a
process on node 1 without it hears nothing on the driver's PUB port and its forged results
change nothing; without a secret (and without cluster.insecure_control_plane) every node
refuses to start. A missing node, an unreachable rendezvous, a world of the wrong size and
configs that differ between nodes fail on every node that is up, with the numbers, in
bounded time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from meshserve.client import Client
from support.multinode import CLI, SECRET, tool, write_config
from support.server import MeshserveProcess, free_port, process_env

PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 8


SPY = """
import json, sys, time, zmq
from meshserve.comm.messages import StepResult, encoder
pub, pull, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
ctx = zmq.Context()
sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(pub)
push.connect(pull)
heard = queued = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for step in range(64):
        try:
            push.send(encoder().encode(StepResult(step, [0, 1], [7, 7])), zmq.NOBLOCK)
            queued += 1
        except zmq.Again:
            break
    if sub.poll(50):
        sub.recv()
        heard += 1
print(json.dumps({"heard": heard, "queued": queued}))
sub.close(linger=0)
push.close(linger=0)
ctx.term()
"""

CLIENT = """
import json, sys
from meshserve.client import Client
with Client(sys.argv[1], timeout=120, secret=sys.argv[4] or None) as client:
    print(json.dumps([client.generate(p, max_tokens=int(sys.argv[2]), temperature=0).token_ids
                      for p in json.loads(sys.argv[3])]))
"""


@pytest.fixture(scope="module")
def one_rank_tokens(tiny_checkpoints, tmp_path_factory):
    """Greedy tokens of the tiny Llama (4 heads, 2 KV heads, 3 layers) on one rank."""
    cfg = write_config(tmp_path_factory.mktemp("ref"), tiny_checkpoints["llama"], "one.yaml", tensor=1)
    out = subprocess.run([*CLI, "generate", str(cfg), "--json", "--max-tokens", str(MAX_TOKENS),
                          *[a for p in PROMPTS for a in ("--prompt", p)]], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tokens = [json.loads(line)["token_ids"] for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


def two_node_config(tmp_path, tiny_checkpoints, nodes, name="two.yaml", port=29500, timeout=120,
                    secret: str | None = SECRET):
    return write_config(tmp_path, tiny_checkpoints["llama"], name, tensor=2, pipeline=2,
                        zmq=f"tcp://{nodes.addresses[0]}:5555", secret=secret,
                        cluster={"nodes": 2, "master_addr": nodes.addresses[0], "master_port": port,
                                 "interface": nodes.interface, "rendezvous_timeout": timeout,
                                 "handshake_timeout": timeout})


def tokens_from_node0(nodes, address: str, secret: str | None = SECRET) -> list[list[int]]:
    """A client inside node 0's namespace, where the driver's ZMQ address is."""
    out = subprocess.run(nodes.cmd(0, [sys.executable, "-c", CLIENT, address, str(MAX_TOKENS), json.dumps(PROMPTS),
                                       secret or ""]), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def serve_two_nodes(nodes, tmp_path, argv_of_node) -> list[MeshserveProcess]:
    """Node 1 first (it waits for node 0's rendezvous), then node 0; returns [node0, node1]."""
    node1 = MeshserveProcess(nodes.cmd(1, argv_of_node(1)), tmp_path, name="node1", raw=True)
    node0 = MeshserveProcess(nodes.cmd(0, argv_of_node(0)), tmp_path, name="node0", raw=True)
    return [node0, node1]


def check_serves_and_stops(nodes, procs, want, exit_code: int | None = 0):
    """`exit_code`: node 0's on SIGTERM (None: the launcher's own, unchecked). While the
    client runs, a process on node 1 without the secret listens on the driver's control-plane
    PUB port and pushes forged results at its PULL port: CURVE keeps it out of both."""
    node0, node1 = procs
    line = node0.wait_ready(240)
    assert "world_size=4" in line and f"zmq=tcp://{nodes.addresses[0]}:5555" in line
    found = re.findall(r"control plane at (tcp://\S+) \(PUB\) (tcp://\S+) \(PULL\): CURVE-encrypted, keys from "
                       r"server.secret, frames authenticated", node0.tail(200_000))
    assert len(found) == 1 and found[0][0].startswith(f"tcp://{nodes.addresses[0]}:"), node0.tail()[-3000:]
    spy = subprocess.Popen(nodes.cmd(1, [sys.executable, "-c", SPY, *found[0], "6"]), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert tokens_from_node0(nodes, f"tcp://{nodes.addresses[0]}:5555") == want
        out, err = spy.communicate(timeout=60)
    finally:
        spy.kill()
    assert spy.returncode == 0, err[-2000:]
    seen = json.loads(out)
    assert seen["heard"] == 0 and seen["queued"] > 0, seen  # its frames never left its queue
    assert "dropped" not in node0.tail(200_000), "a frame from outside reached the driver"
    code = node0.stop()
    assert exit_code is None or code == exit_code, node0.tail()
    # node 1's ranks follow the driver's Shutdown and exit; so does its agent
    assert node1.proc.wait(90) == 0, node1.tail()


@pytest.mark.slow
def test_two_nodes_serve_node_rank_tp2_pp2_matches_one_rank(nodes, tmp_path, tiny_checkpoints, one_rank_tokens):
    cfg = two_node_config(tmp_path, tiny_checkpoints, nodes)
    procs = serve_two_nodes(nodes, tmp_path, lambda k: [*CLI, "serve", str(cfg), "--node-rank", str(k)])
    try:
        check_serves_and_stops(nodes, procs, one_rank_tokens)
    finally:
        for p in procs:
            p.kill()


def replicas_config(tmp_path, tiny_checkpoints, nodes, name: str, zmq_port: int, port: int) -> tuple[str, Path]:
    """A config of one-rank replicas spread over the two nodes: (node 0's client address, file)."""
    address = f"tcp://{nodes.addresses[0]}:{zmq_port}"
    return address, write_config(tmp_path, tiny_checkpoints["llama"], name, tensor=1, zmq=address, secret=SECRET,
                                 cluster={"nodes": 2, "master_addr": nodes.addresses[0], "master_port": port,
                                          "interface": nodes.interface, "rendezvous_timeout": 120,
                                          "handshake_timeout": 120})


@pytest.mark.slow
def test_two_nodes_one_replica_each_behind_node0s_front_door(nodes, tmp_path, tiny_checkpoints, one_rank_tokens):
    """parallel.data=2 over two nodes: node 0 runs the front door and replica 0, node 1
    replica 1, which it announces to node 0 and stops when node 0 stops."""
    address, cfg = replicas_config(tmp_path, tiny_checkpoints, nodes, "dp2.yaml", 5557, 29530)
    procs = serve_two_nodes(nodes, tmp_path, lambda k: [*CLI, "serve", str(cfg), "--set", "parallel.data=2",
                                                        "--node-rank", str(k)])
    node0, node1 = procs
    try:
        line = node0.wait_ready(240)
        assert "replicas=2" in line and f"zmq={address}" in line
        assert f"replica 1 serves at tcp://{nodes.addresses[1]}:" in node0.tail(200_000)
        # one request after the other: least-loaded routing alternates (fewest routed first)
        assert tokens_from_node0(nodes, address) == one_rank_tokens
        assert node0.stop() == 0, node0.tail()
        assert node1.proc.wait(90) == 0, node1.tail()
        served = re.findall(r"replica (\d) \| .*stopped after \d+ steps, (\d+) requests", node0.tail(200_000) +
                            node1.tail(200_000))
        assert sorted(served) == [("0", "1"), ("1", "1")], served
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow
def test_a_replica_on_node1_that_fails_is_started_again_by_its_node(nodes, tmp_path, tiny_checkpoints,
                                                                      one_rank_tokens):
    """parallel.data=2 over two nodes, node 1's replica SIGKILLed: node 1 starts it again and
    announces it anew; node 0's front door routes to it again, with one rank's tokens."""
    address, cfg = replicas_config(tmp_path, tiny_checkpoints, nodes, "heal.yaml", 5559, 29545)
    procs = serve_two_nodes(nodes, tmp_path, lambda k: [*CLI, "serve", str(cfg), "--set", "parallel.data=2",
                                                        "--set", "router.restart_backoff=0.2", "--node-rank", str(k)])
    node0, node1 = procs
    try:
        node0.wait_ready(240)
        replica = next(pid for pid in node1.descendants() if process_env(pid) is not None
                       and process_env(pid).get(b"MESHSERVE_REPLICA") == b"1")
        os.kill(replica, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while "replica 1 serves again (restart 1)" not in node0.tail(200_000):
            assert time.monotonic() < deadline, node0.tail() + node1.tail()
            time.sleep(0.3)
        assert "replica 1 is out of service: killed by SIGKILL (restarted in 0.2 s)" in node0.tail(200_000)
        assert tokens_from_node0(nodes, address) == one_rank_tokens  # both replicas: least-loaded alternates
        assert node0.stop() == 0, node0.tail()
        assert node1.proc.wait(90) == 0, node1.tail()
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow
def test_prefill_on_node0_and_decode_on_node1(nodes, tmp_path, tiny_checkpoints, one_rank_tokens):
    """Disaggregated across the nodes: replica 0 (node 0) computes every prompt and sends its
    KV over cluster.interface to replica 1 (node 1), which decodes: the tokens of one rank,
    KV bytes landed on node 1, and no prompt token computed there."""
    address, cfg = replicas_config(tmp_path, tiny_checkpoints, nodes, "pd.yaml", 5558, 29535)
    procs = serve_two_nodes(nodes, tmp_path, lambda k: [
        *CLI, "serve", str(cfg), "--set", "parallel.data=2", "--set", "disaggregation.prefill_replicas=1",
        "--set", "server.http=0.0.0.0:0", "--node-rank", str(k)])
    node0, node1 = procs
    try:
        line = node0.wait_ready(240)
        url = re.search(r"http=(http://\S+)", line).group(1).replace("0.0.0.0", nodes.addresses[0])
        assert f"replica 1 serves at tcp://{nodes.addresses[1]}:" in node0.tail(200_000)
        assert tokens_from_node0(nodes, address) == one_rank_tokens
        metrics = subprocess.run(nodes.cmd(0, ["curl", "-s", f"{url}/metrics"]), capture_output=True, text=True,
                                 timeout=60).stdout
        computed = {k: v for k, v in re.findall(r'^meshserve_prompt_tokens_computed_total\{replica="(\d)"\} (\S+)$',
                                                metrics, re.M)}
        landed = re.findall(r'^meshserve_kv_transfers\{outcome="landed",replica="1"\} (\S+)$', metrics, re.M)
        assert float(computed["1"]) == 0 and float(computed["0"]) > 0, computed
        assert landed and float(landed[0]) == len(PROMPTS), metrics[-3000:]
        assert node0.stop() == 0, node0.tail()
        assert node1.proc.wait(90) == 0, node1.tail()
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow
def test_two_nodes_torchrun_c10d_tp2_pp2_matches_one_rank(nodes, tmp_path, tiny_checkpoints, one_rank_tokens):
    """torchrun's c10d rendezvous hosted on node 0; each node's own address as --local-addr."""
    cfg = two_node_config(tmp_path, tiny_checkpoints, nodes, port=29510)
    endpoint = f"{nodes.addresses[0]}:29510"

    def argv(k):
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "multinode-test",
                "--rdzv-conf", f"is_host={int(k == 0)}", "--local-addr", nodes.addresses[k],
                "-m", "meshserve.launcher.cli", "worker", str(cfg)]

    procs = serve_two_nodes(nodes, tmp_path, argv)
    try:
        check_serves_and_stops(nodes, procs, one_rank_tokens, exit_code=None)  # torchrun: 1 on SIGTERM
    finally:
        for p in procs:
            p.kill()


def test_two_nodes_without_a_secret_refuse_to_start_on_every_node(nodes, tmp_path, tiny_checkpoints):
    cfg = two_node_config(tmp_path, tiny_checkpoints, nodes, name="open.yaml", port=29540, secret=None)
    env = {k: v for k, v in os.environ.items() if k != "MESHSERVE_SECRET"}
    start = time.monotonic()
    procs = [subprocess.Popen(nodes.cmd(k, [*CLI, "serve", str(cfg), "--node-rank", str(k)]), text=True, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k in (1, 0)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2, err[-2000:]
        assert ("meshserve: config error: " in err and "cluster.nodes=2 without server.secret" in err
                and "cluster.insecure_control_plane=true" in err), err[-2000:]
        assert "joining the world" not in err  # before any rank started
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_configs_that_differ_between_nodes_fail_on_every_node(nodes, tmp_path, tiny_checkpoints):
    cfg = two_node_config(tmp_path, tiny_checkpoints, nodes, port=29520)
    start = time.monotonic()
    procs = serve_two_nodes(nodes, tmp_path, lambda k: [*CLI, "serve", str(cfg), "--node-rank", str(k),
                                                        *(["--set", "scheduler.max_num_seqs=8"] if k else [])])
    try:
        codes = [p.proc.wait(180) for p in procs]
        logs = [p.tail(200_000) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert time.monotonic() - start < 180
    pattern = re.compile(r"the ranks loaded different configs: config hash ([0-9a-f]{16}) on ranks 0-1 \(.*\) "
                         r"but ([0-9a-f]{16}) on ranks 2-3")
    for node, (code, log) in enumerate(zip(codes, logs)):
        assert code == 1, log[-3000:]
        found = pattern.search(log)
        assert found and found.group(1) != found.group(2), f"node {node}:\n{log[-3000:]}"
        assert "died first" in log


def test_missing_node_and_unreachable_rendezvous_fail_within_the_timeout(nodes, tmp_path, tiny_checkpoints):
    """Node 1 alone (nobody hosts its rendezvous) and node 0 alone (nobody joins it), at once
    on two ports, each with a 5 s cluster.rendezvous_timeout."""
    lone1 = two_node_config(tmp_path, tiny_checkpoints, nodes, name="lone1.yaml", port=29531, timeout=5)
    lone0 = two_node_config(tmp_path, tiny_checkpoints, nodes, name="lone0.yaml", port=29532, timeout=5)
    start = time.monotonic()
    procs = [subprocess.Popen(nodes.cmd(k, [*CLI, "serve", str(cfg), "--node-rank", str(k)]), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k, cfg in ((1, lone1), (0, lone0))]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    elapsed = time.monotonic() - start
    (_, err1), (_, err0) = outs
    assert procs[0].returncode == 1 and procs[1].returncode == 1, (err1[-2000:], err0[-2000:])
    assert (f"meshserve: node 1: waited 5 s (cluster.rendezvous_timeout) for node 0's rendezvous at "
            f"{nodes.addresses[0]}:29531") in err1, err1[-2000:]
    assert (f"meshserve: node 0: waited 5 s (cluster.rendezvous_timeout) for nodes 1 .. 1 to join the rendezvous "
            f"it hosts at {nodes.addresses[0]}:29532") in err0, err0[-2000:]
    assert elapsed < 60


@pytest.mark.slow
def test_mpiexec_tp2_pp2_matches_one_rank(tmp_path, tiny_checkpoints, one_rank_tokens):
    cfg = write_config(tmp_path, tiny_checkpoints["llama"], "mpi.yaml", tensor=2, pipeline=2)
    address = yaml.safe_load(cfg.read_text())["server"]["zmq"]
    server = MeshserveProcess([tool("mpiexec"), "-n", "4", *CLI, "worker", str(cfg)], tmp_path, name="mpi", raw=True)
    try:
        assert "world_size=4" in server.wait_ready(240)
        with Client(address, timeout=120) as client:
            got = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).token_ids for p in PROMPTS]
        assert got == one_rank_tokens
        assert server.stop() == 0, server.tail()
        assert not server.group_alive()
    finally:
        server.kill()


@pytest.mark.slow
def test_deepspeed_launcher_tp2_matches_one_rank(tmp_path, tiny_checkpoints, one_rank_tokens):
    """`deepspeed --num_gpus 2` on CPU (its CPU accelerator): RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_SIZE, MASTER_*; `--local_rank=N` before the command is accepted and ignored."""
    cfg = write_config(tmp_path, tiny_checkpoints["llama"], "ds.yaml", tensor=2)
    address = yaml.safe_load(cfg.read_text())["server"]["zmq"]
    cmd = [tool("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "--module", "meshserve.launcher.cli", "worker", str(cfg)]
    server = MeshserveProcess(cmd, tmp_path, name="deepspeed", raw=True)
    try:
        assert "world_size=2" in server.wait_ready(240)
        with Client(address, timeout=120) as client:
            got = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).token_ids for p in PROMPTS]
        assert got == one_rank_tokens
        # deepspeed's runner exits 1 at once on SIGTERM; its per-node launcher then stops the ranks
        server.stop()
        deadline = time.monotonic() + 60
        while server.group_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not server.group_alive()
    finally:
        server.kill()


def test_world_of_the_wrong_size_fails_on_every_rank(tmp_path, tiny_checkpoints):
    cfg = write_config(tmp_path, tiny_checkpoints["llama"], "wrong.yaml", tensor=2, pipeline=2)
    start = time.monotonic()
    out = subprocess.run([tool("mpiexec"), "-n", "2", *CLI, "worker", str(cfg)], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode != 0
    message = "started 2 ranks but the config needs parallel.tensor x pipeline x context = 2 x 2 x 1 = 4"
    for rank in (0, 1):
        assert f"meshserve: rank {rank} (node 0): mpiexec (PMI) {message}" in out.stderr, out.stderr[-3000:]
    assert time.monotonic() - start < 120
