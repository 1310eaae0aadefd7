"""The only place that reads environment variables: the launchers' rank variables and
the user's thread setting."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankEnv:
    global_rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def cpu_threads(configured: int | None, local_world_size: int) -> int:
    """Intra-op threads per rank: the config's, else OMP_NUM_THREADS if the user set it,
    else cores / local ranks, so that ranks on one node do not starve each other."""
    if configured:
        return configured
    user = os.environ.get("OMP_NUM_THREADS")
    if user and user.isdigit() and int(user) > 0:
        return int(user)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def rank_env_from_environ() -> RankEnv:
    """This process's place in the world, from the variables torchrun / torch elastic set."""
    env = os.environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise RuntimeError(f"no launcher environment: {', '.join(missing)} unset (start `meshserve worker` "
                           f"under torchrun, or use `meshserve serve`, which starts the ranks itself)")
    world = int(env["WORLD_SIZE"])
    return RankEnv(
        global_rank=int(env["RANK"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        world_size=world,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
    )
