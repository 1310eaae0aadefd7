"""`meshserve serve` with parallel.data > 1: the front door, and each replica started as a
deployment of its own.

Each replica is a child `meshserve serve` (the same command, config and flags, with
parallel.data=1, its own loopback ZMQ and HTTP ports and its share of the cores), which
starts its ranks as any single-replica deployment does, torch's elastic agent included.
That is what isolates a failure: a rank that dies takes down its replica's agent and
ranks, and nothing else, since the replicas share no launcher and no torch.distributed
world (under torchrun, by contrast, one failed rank stops every rank of the node: its
agent tears the whole worker group down). The front door (engine/serving/replicas) sees the child
exit and takes the replica out of service.

Children run in sessions of their own (a terminal's Ctrl-C reaches the front door only,
which forwards the stop to every replica and waits for them to drain) and get SIGTERM when
the front door dies (PR_SET_PDEATHSIG), so nothing outlives it.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from meshserve.configs.cpu_bind import auto_share, parse_cpu_list
from meshserve.configs.cpu_features import usable_cores
from meshserve.configs.schema import Config
from meshserve.launcher import flags
from meshserve.launcher.lifetime import die_with_parent
from meshserve.launcher.network import free_port

log = logging.getLogger("meshserve")

READY = re.compile(r"meshserve ready zmq=(\S+) http=(\S+)")
RELAY_GRACE_S = 1.0
STOP_GRACE_S = 15.0
"""After the drain timeout, how long a replica gets to exit before it is killed."""


@dataclass
class ReplicaProcess:
    index: int
    process: subprocess.Popen
    zmq: str | None = None
    http: str | None = None
    """Its HTTP base URL (for /metrics and /reset_prefix_cache)."""
    ready: threading.Event = field(default_factory=threading.Event)
    ready_at: float | None = None
    """When it said it serves (time.monotonic())."""
    last_words: str = ""
    """Its last `meshserve:` line (why it exited)."""

    def exit_reason(self, code: int) -> str:
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"{how}: {self.last_words}" if self.last_words else how


def core_shares(config: Config, cores: list[int] | None = None) -> list[list[int] | None]:
    """The cores of each local rank of the node (all replicas' ranks, replica by replica),
    or None each where device.cpu_bind=none or the node has fewer cores than ranks (the
    replicas then share the cores, each rank on one thread)."""
    n = config.ranks_per_node
    cores = usable_cores() if cores is None else cores
    bind = config.device.cpu_bind
    if isinstance(bind, list):
        return [parse_cpu_list(item) for item in bind]
    if bind == "none" or n > len(cores):
        return [None] * n
    return [auto_share(cores, i, n) for i in range(n)]


def replica_overrides(config: Config, local_index: int, shares: list[list[int] | None], zmq_port: int,
                      host: str = "127.0.0.1") -> list[str]:
    """The --set items that make the config one replica's: one replica on one node, its ZMQ
    and HTTP on ports of its own at `host` (where the front door reaches it), on its ranks'
    cores."""
    size = config.world_size
    mine = shares[local_index * size:(local_index + 1) * size]
    sets = ["parallel.data=1", f"server.zmq=tcp://{host}:{zmq_port}", f"server.http={host}:0",
            "cluster.nodes=1", f"cluster.ranks_per_node={size}", "cluster.master_addr=null"]
    if config.device.type == "cpu":
        if all(share is not None for share in mine):
            sets.append("device.cpu_bind=[" + ",".join(f'"{_cpu_list(s)}"' for s in mine) + "]")
        else:
            sets += ["device.cpu_bind=none", f"device.threads={config.device.threads or 1}"]
    return [item for s in sets for item in ("--set", s)]


def disaggregation_overrides(config: Config, replica: int, store: str) -> list[str]:
    """The --set items that tell replica `replica` its place in disaggregated prefill/decode:
    which replica it is, of how many, and where the ranks meet (`store`, host:port)."""
    if not config.disaggregation.enabled:
        return []
    sets = [f"disaggregation.replica={replica}", f"disaggregation.replicas={config.parallel.data}",
            f"disaggregation.store={store}"]
    return [item for s in sets for item in ("--set", s)]


def _cpu_list(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def start_replica(index: int, argv: list[str], sets: list[str], on_exit) -> ReplicaProcess:
    """Start replica `index`: `meshserve <argv> <sets>`; its output goes to this process's
    stderr, each line prefixed with the replica; `on_exit(index, reason)` runs (on a thread
    of its own) when it ends."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MESHSERVE_REPLICA=str(index))
    process = subprocess.Popen([sys.executable, "-m", "meshserve.launcher.cli", *argv, *sets], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True, preexec_fn=die_with_parent, text=True, bufsize=1)
    replica = ReplicaProcess(index, process)

    def relay() -> None:
        for line in process.stdout:
            match = READY.search(line)
            if match and not replica.ready.is_set():
                replica.zmq, http = match.group(1), match.group(2)
                replica.http = None if http == "off" else http
                replica.ready_at = time.monotonic()
                replica.ready.set()
            elif line.startswith("meshserve:"):
                replica.last_words = line.strip().removeprefix("meshserve:").strip()
            sys.stderr.write(f"replica {index} | {line}")

    def wait() -> None:
        code = process.wait()
        relaying.join(RELAY_GRACE_S)  # its last words (a rank it started may hold the pipe open longer)
        on_exit(index, replica.exit_reason(code))

    relaying = threading.Thread(target=relay, name=f"meshserve-replica-{index}-output", daemon=True)
    relaying.start()
    threading.Thread(target=wait, name=f"meshserve-replica-{index}", daemon=True).start()
    return replica


def replica_argv(args_argv: list[str]) -> list[str]:
    """The command line the front door was started with, for a replica (`serve` and its
    flags; the API key travels in the environment, never on a command line)."""
    argv = flags.without_api_key(args_argv)
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == "--node-rank":
            skip = True
            continue
        if item.startswith("--node-rank="):
            continue
        out.append(item)
    return out


def stop_replicas(replicas: list[ReplicaProcess], sig: int = signal.SIGTERM) -> None:
    for replica in replicas:
        if replica.process.poll() is None:
            try:
                os.killpg(replica.process.pid, sig)
            except ProcessLookupError:
                pass


def wait_stopped(replicas: list[ReplicaProcess], timeout: float) -> None:
    """Wait up to `timeout` for every replica to exit; then kill what is left."""
    deadline = time.monotonic() + timeout
    for replica in replicas:
        try:
            replica.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("replica %d did not stop within %.0f s: killed", replica.index, timeout)
            stop_replicas([replica], signal.SIGKILL)
            replica.process.wait()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports
