"""Start this node's ranks with torch's elastic agent (the machinery under torchrun):
each rank re-runs the same command with `--as-rank`, reading its place in the world
from the launcher's variables. A rank that dies takes the others down and makes
the command exit non-zero, naming the rank.

One node: a c10d rendezvous on a free loopback port. Several nodes (`cluster.nodes > 1`,
`meshserve serve CONFIG --node-rank K` on each): node 0 hosts the rendezvous store at
cluster.master_addr:master_port and the others join it (torch elastic's static TCP
rendezvous, the one torchrun uses with --node-rank). Global ranks follow node ranks:
node K runs ranks K x ranks_per_node onwards, so rank 0, the driver, is on node 0.
"""

from __future__ import annotations

import logging
import sys
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshserve.configs.errors import ConfigError
from meshserve.configs.schema import Config
from meshserve.launcher.env import cap_cpu_threads_for_ranks, use_network_interface
from meshserve.launcher.failure_report import reported_reason
from meshserve.launcher.network import free_port, interface_address

log = logging.getLogger("meshserve")

# NOTE: every node must name the same run; one deployment per rendezvous address and port.
MULTINODE_RUN_ID = "meshserve"


class _ShutdownWords(logging.Filter):
    """torch elastic's agent announces a normal stop as warnings about "death signals"
    (`Received 15 death signal, shutting down workers`, then one `Sending process N closing
    signal SIGTERM` per rank): said once instead, as what it is."""

    def __init__(self, shutdown_timeout: float):
        super().__init__()
        self.shutdown_timeout = shutdown_timeout

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str):
            return True
        if record.msg.startswith("Sending process %s closing signal"):
            return False
        if record.msg.startswith("Received %s death signal"):
            signame = getattr(record.args[0], "name", record.args[0]) if record.args else "a signal"
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = ("%s: the driver drains its requests, then the ranks stop (the launcher "
                                       "waits up to %.0f s for them)", (signame, self.shutdown_timeout))
        return True


ELASTIC_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


def _launch_config(config: Config, node_rank: int | None, shutdown_timeout: float) -> LaunchConfig:
    cluster = config.cluster
    common = dict(nproc_per_node=config.ranks_per_node, max_restarts=0, monitor_interval=0.5,
                  shutdown_timeout=int(shutdown_timeout))
    if cluster.nodes == 1:
        if node_rank not in (None, 0):
            raise ConfigError(f"--node-rank {node_rank}: the config has cluster.nodes=1 (node rank 0 only)")
        return LaunchConfig(min_nodes=1, max_nodes=1, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                            rdzv_endpoint=f"127.0.0.1:{free_port()}", **common)
    if node_rank is None or not 0 <= node_rank < cluster.nodes:
        given = "none given" if node_rank is None else f"got {node_rank}"
        raise ConfigError(f"cluster.nodes={cluster.nodes}: start `meshserve serve CONFIG --node-rank K` on each node, "
                          f"K = 0 .. {cluster.nodes - 1} ({given}); or start the ranks with torchrun, mpirun or "
                          f"deepspeed and `meshserve worker`")
    if not cluster.master_addr:
        raise ConfigError(f"cluster.nodes={cluster.nodes}: set cluster.master_addr, node 0's address that every "
                          f"node reaches (the rendezvous is at cluster.master_addr:cluster.master_port)")
    local_addr = interface_address(cluster.interface) if cluster.interface else None
    return LaunchConfig(min_nodes=cluster.nodes, max_nodes=cluster.nodes, run_id=MULTINODE_RUN_ID,
                        rdzv_backend="static", rdzv_endpoint=f"{cluster.master_addr}:{cluster.master_port}",
                        rdzv_configs={"rank": node_rank, "timeout": cluster.rendezvous_timeout},
                        local_addr=local_addr, **common)


def _rendezvous_failure(config: Config, node_rank: int, error: Exception) -> str:
    cluster = config.cluster
    where = f"{cluster.master_addr}:{cluster.master_port}"
    if node_rank == 0:
        awaited = f"nodes 1 .. {cluster.nodes - 1} to join the rendezvous it hosts at {where}"
    else:
        awaited = f"node 0's rendezvous at {where} (cluster.master_addr:cluster.master_port)"
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return (f"meshserve: node {node_rank}: waited {cluster.rendezvous_timeout} s (cluster.rendezvous_timeout) for "
            f"{awaited}: {first}")


def spawn_local_ranks(config: Config, python_args: list[str], shutdown_timeout: float,
                      node_rank: int | None = None) -> int:
    """Run `python <python_args>` on this node's ranks (each reads its rank from the
    launcher's variables); returns the exit code."""
    launch = _launch_config(config, node_rank, shutdown_timeout)
    if config.device.type == "cpu":
        capped = cap_cpu_threads_for_ranks(config.device, config.ranks_per_node)
        if capped:
            log.warning("%s", capped)
    if config.cluster.interface:
        use_network_interface(config.cluster.interface)
    words = _ShutdownWords(shutdown_timeout)
    for name in ELASTIC_LOGGERS:
        logging.getLogger(name).addFilter(words)
    try:
        elastic_launch(launch, sys.executable)(*python_args)
    except ChildFailedError as e:
        first_rank, first = e.get_first_failure()
        failures = ", ".join(f"rank {r} ({_how(f)})" for r, f in sorted(e.failures.items()))
        reason = reported_reason(first.error_file_data)
        if reason is None:
            print(f"meshserve: rank {first_rank} died first ({_how(first)}); failed: {failures}", file=sys.stderr)
        else:  # e.g. the driver saw another rank hang, and exited first
            print(f"meshserve: {reason} (reported by rank {first_rank}, which then exited: {_how(first)}); "
                  f"failed: {failures}", file=sys.stderr)
        return 1
    except SignalException as e:
        # The agent forwarded the signal; the driver drained and stopped the other ranks.
        log.info("stopped by %s", e.sigval.name)
        return 0
    except Exception as e:  # the rendezvous: torch raises DistStoreError, DistNetworkError, RendezvousError...
        if config.cluster.nodes == 1:
            raise
        print(_rendezvous_failure(config, node_rank, e), file=sys.stderr)
        return 1
    return 0


def _how(failure) -> str:
    """`killed by SIGKILL` or `exit code 1`, for a torch elastic ProcessFailure."""
    return f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
