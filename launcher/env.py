"""The only place that reads (or writes) environment variables: the launchers' rank
variables, the user's thread setting, the socket interface for gloo/NCCL, the server's
secrets (MESHSERVE_SECRET, MESHSERVE_API_KEY), and torch elastic's error file.

Who started this rank decides which variables describe it:

| launcher                          | rank, world size     | local rank, ranks on this node        | node           |
| --------------------------------- | -------------------- | ------------------------------------- | -------------- |
| torchrun, `meshserve serve`       | RANK, WORLD_SIZE     | LOCAL_RANK, LOCAL_WORLD_SIZE          | GROUP_RANK     |
| deepspeed                         | RANK, WORLD_SIZE     | LOCAL_RANK, LOCAL_SIZE                | CROSS_RANK     |
| mpirun / mpiexec (Open MPI)       | OMPI_COMM_WORLD_RANK, _SIZE | OMPI_COMM_WORLD_LOCAL_RANK, _LOCAL_SIZE | -   |
| mpiexec (MPICH, Intel MPI), srun  | PMI_RANK, PMI_SIZE   | MPI_LOCALRANKID, MPI_LOCALNRANKS      | -              |

torchrun-style launchers also give MASTER_ADDR/MASTER_PORT; under MPI, rank 0 picks them and
broadcasts them with mpi4py (`launcher/mpi.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from meshserve.configs.cpu_bind import rank_cores, thread_share
from meshserve.configs.cpu_features import usable_cores
from meshserve.configs.schema import ClusterConfig, Config, DeviceConfig


@dataclass(frozen=True)
class RankEnv:
    global_rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node_rank: int = 0
    launcher: str = "meshserve"
    """Who started the ranks, for messages (`torchrun`, `deepspeed`, `mpiexec (MPICH)`, ...)."""


@dataclass(frozen=True)
class MpiWorld:
    """This process's place in an MPI job, as the MPI launcher's variables tell it."""

    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    launcher: str


@dataclass(frozen=True)
class CpuPlacement:
    """Where a rank's intra-op threads run."""

    threads: int
    cores: list[int] | None
    """The rank's cores (to bind to), or None with device.cpu_bind=none."""
    capped: str | None = None
    """Why the user's thread count was lowered (for a warning), else None."""


def user_threads() -> int | None:
    """OMP_NUM_THREADS, if the user set it to a number."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def cpu_placement(device: DeviceConfig, local_rank: int, local_world_size: int,
                  cores: list[int] | None = None) -> CpuPlacement:
    """This rank's cores (device.cpu_bind, meshserve.configs.cpu_bind) and threads: the
    config's device.threads, else OMP_NUM_THREADS, else one per core of its share, and never
    more than its share: the ranks of a node together run at most as many threads as it has
    cores (one each when there are more ranks than cores)."""
    available = cores if cores is not None else usable_cores()
    mine = rank_cores(device.cpu_bind, available, local_rank, local_world_size)
    share = thread_share(mine, available, local_world_size)
    wanted = device.threads or user_threads()
    if wanted is None or wanted <= share:
        return CpuPlacement(wanted or share, mine)
    source = "device.threads" if device.threads else "OMP_NUM_THREADS"
    return CpuPlacement(share, mine, f"{source}={wanted} x {local_world_size} local ranks = "
                                     f"{wanted * local_world_size} threads on {len(available)} cores: capped at "
                                     f"{share} thread{'s' if share > 1 else ''} per rank")


SECRET_VARIABLES = {"secret": "MESHSERVE_SECRET", "api_key": "MESHSERVE_API_KEY",
                    "admin_key": "MESHSERVE_ADMIN_KEY"}
"""server.<key> -> the variable that fills it when the config leaves it null."""


def secrets_from_environ(config: Config) -> Config:
    """`config` with server.secret, server.api_key and server.admin_key taken from
    MESHSERVE_SECRET, MESHSERVE_API_KEY and MESHSERVE_ADMIN_KEY where it leaves them null (an empty variable counts as unset). The
    ranks `meshserve serve` starts inherit the variables, so each fills in the same values."""
    found = {key: os.environ[var] for key, var in SECRET_VARIABLES.items()
             if getattr(config.server, key) is None and os.environ.get(var)}
    if not found:
        return config
    return config.model_copy(update={"server": config.server.model_copy(update=found)})


def elastic_error_file() -> str | None:
    """TORCHELASTIC_ERROR_FILE: where torch elastic's agent reads why this rank failed."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None


def export_api_key(key: str) -> None:
    """Give the ranks this process starts the API key in their environment (--api-key)."""
    os.environ[SECRET_VARIABLES["api_key"]] = key


def api_key_from_environ() -> str | None:
    """MESHSERVE_API_KEY, for `meshserve bench --api-key`'s default."""
    return os.environ.get(SECRET_VARIABLES["api_key"]) or None


def admin_key_from_environ() -> str | None:
    """MESHSERVE_ADMIN_KEY, for `meshserve admin --admin-key`'s default."""
    return os.environ.get(SECRET_VARIABLES["admin_key"]) or None


def cap_cpu_threads_for_ranks(device: DeviceConfig, local_world_size: int) -> str | None:
    """Before this process starts a node's ranks: a thread count (device.threads or
    OMP_NUM_THREADS) that would oversubscribe the cores comes down to each rank's share,
    in OMP_NUM_THREADS, which the ranks inherit. Returns why, for a warning, or None."""
    placement = cpu_placement(device, 0, local_world_size)
    if placement.capped is not None:
        os.environ["OMP_NUM_THREADS"] = str(placement.threads)
    return placement.capped


def bind_to_cores(cores: list[int]) -> None:
    """Run this process (and the threads it starts from now on) on `cores` only."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


def use_network_interface(name: str) -> None:
    """gloo and NCCL open their sockets on interface `name` (cluster.interface), in this
    process and in the ranks it starts."""
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ["NCCL_SOCKET_IFNAME"] = name


def _int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def mpi_world_from_environ() -> MpiWorld | None:
    """The MPI launcher's view of this process, or None when no MPI launcher started it."""
    if _int("OMPI_COMM_WORLD_RANK") is not None:
        return MpiWorld(_int("OMPI_COMM_WORLD_RANK"), _int("OMPI_COMM_WORLD_SIZE"),
                        _int("OMPI_COMM_WORLD_LOCAL_RANK"), _int("OMPI_COMM_WORLD_LOCAL_SIZE"), "mpirun (Open MPI)")
    if _int("PMI_RANK") is not None and _int("PMI_SIZE") is not None:
        return MpiWorld(_int("PMI_RANK"), _int("PMI_SIZE"), _int("MPI_LOCALRANKID"), _int("MPI_LOCALNRANKS"),
                        "mpiexec (PMI)")
    return None


def _torch_style_launcher() -> str:
    env = os.environ
    if "CROSS_RANK" in env and "LOCAL_SIZE" in env:
        return "deepspeed"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    return "the launcher"


def rank_env_from_environ(cluster: ClusterConfig | None = None) -> RankEnv:
    """This process's place in the world, from the variables its launcher set (torchrun,
    torch elastic, deepspeed; or an MPI launcher, bootstrapped through mpi4py)."""
    env = os.environ
    if "RANK" not in env:
        mpi = mpi_world_from_environ()
        if mpi is not None:
            from meshserve.launcher.mpi import bootstrap

            return bootstrap(mpi, cluster or ClusterConfig())
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise RuntimeError(f"no launcher environment: {', '.join(missing)} unset (start `meshserve worker` under "
                           f"torchrun, mpirun/mpiexec or deepspeed, or use `meshserve serve`, which starts the "
                           f"ranks itself)")
    world = int(env["WORLD_SIZE"])
    rank = int(env["RANK"])
    local_world = _int("LOCAL_WORLD_SIZE") or _int("LOCAL_SIZE") or world
    node = _int("GROUP_RANK")
    if node is None:
        node = _int("CROSS_RANK")
    return RankEnv(
        global_rank=rank,
        local_rank=_int("LOCAL_RANK") or 0,
        world_size=world,
        local_world_size=local_world,
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
        node_rank=rank // local_world if node is None else node,
        launcher=_torch_style_launcher(),
    )
