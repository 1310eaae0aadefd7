"""Run a function on N gloo ranks on CPU (free port, timeout, the failing rank's
traceback re-raised). Run several checks per spawn: a spawn costs seconds here."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

from meshserve.launcher.network import free_port
from meshserve.parallel.process_groups import destroy_process_groups, init_process_groups
from meshserve.parallel.topology import Topology


def _entry(fn, rank, topology, port, args, queue, collected, shm_slot_bytes):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    try:
        groups = init_process_groups(topology, rank, "127.0.0.1", port, timeout_s=120, shm_slot_bytes=shm_slot_bytes)
        queue.put((rank, "ok", fn(groups, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # NOTE: a tensor goes through the queue as a handle to this process's shared memory,
        # which the parent can open only while this process lives.
        collected.wait(timeout=60)
        destroy_process_groups()


def run_ranks(fn, topology: Topology, *args, timeout: float = 300.0, shm_slot_bytes: int = 4 << 20) -> list:
    """fn(groups, *args) on every rank of `topology`; returns the results in rank order.
    fn must be importable (a module-level function) and return picklable values.
    `shm_slot_bytes=0` keeps every TP collective on gloo."""
    ctx = mp.get_context("spawn")
    queue, collected = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, topology, port, args, queue, collected, shm_slot_bytes),
                         daemon=True)
             for r in range(topology.world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in procs:
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        collected.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(topology.world_size)]
