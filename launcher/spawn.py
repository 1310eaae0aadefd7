"""Start this node's ranks with torch's elastic agent (the machinery under torchrun):
each rank re-runs the same command with `--as-rank`, reading its place in the world
from the launcher's variables. A rank that dies takes the others down and makes
the command exit non-zero, naming the rank."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshserve.configs.schema import Config
from meshserve.launcher.env import cpu_threads

log = logging.getLogger("meshserve")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local_ranks(config: Config, python_args: list[str], shutdown_timeout: float) -> int:
    """Run `python <python_args>` on config.world_size local ranks (each reads its rank from
    the launcher's variables); returns the exit code."""
    nproc = config.world_size
    if config.device.type == "cpu":
        # Every rank inherits this; intra-op threads per rank = cores / local ranks unless set.
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads(config.device.threads, nproc))
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
        monitor_interval=0.5, shutdown_timeout=int(shutdown_timeout),
    )
    try:
        elastic_launch(launch, sys.executable)(*python_args)
    except ChildFailedError as e:
        failures = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(e.failures.items()))
        print(f"meshserve: a rank died: {failures}", file=sys.stderr)
        return 1
    except SignalException as e:
        # The agent forwarded the signal; the driver drained and stopped the other ranks.
        log.info("stopped by %s", e.sigval.name)
        return 0
    return 0
