"""torch.distributed initialisation and the per-axis process groups, built once."""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from meshserve.comm.control import broadcast_text
from meshserve.comm.groups import AxisGroup
from meshserve.comm.shm import ShmCommunicator, new_segment_name
from meshserve.parallel.topology import Groups, Topology


def init_process_groups(topology: Topology, global_rank: int, master_addr: str, master_port: int,
                        device_type: str = "cpu", local_rank: int = 0, timeout_s: float = 300.0,
                        shm_slot_bytes: int = 0) -> Groups:
    """Join the world and build every tp / ep / cp / pp group (every rank creates every group,
    in the same order, as torch.distributed requires). Device groups use NCCL on CUDA
    (device = local rank) and gloo on CPU; each axis also gets a gloo group for host tensors.
    On CPU, with `shm_slot_bytes`, the TP group (always inside one node) also gets a
    shared-memory communicator for its all-reduces and gathers."""
    if topology.world_size == 1:
        return Groups.single()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        join_world(global_rank, topology.world_size, master_addr, master_port, device_type, local_rank, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    axes = {}
    for axis in ("tp", "ep", "cp", "pp"):
        mine = topology.axis_ranks(global_rank, axis)
        for ranks in topology.all_axis_groups(axis):
            device_group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
            cpu_group = (device_group if backend == "gloo"
                         else dist.new_group(list(ranks), backend="gloo", timeout=timeout))
            if ranks == mine:
                axes[axis] = AxisGroup(axis, len(ranks), ranks.index(global_rank), ranks, device_group, cpu_group)
    if device_type == "cpu" and shm_slot_bytes and axes["tp"].size > 1:
        axes["tp"] = _with_shm(axes["tp"], shm_slot_bytes, timeout_s)
    return Groups(global_rank, topology.world_size, axes["tp"], axes["pp"], axes["cp"], axes["ep"])


def join_world(global_rank: int, world_size: int, master_addr: str, master_port: int, device_type: str = "cpu",
               local_rank: int = 0, timeout_s: float = 300.0) -> None:
    """Join the world's default process group, waiting up to `timeout_s` for every rank.
    Its CPU tensors go over gloo also on CUDA (start-up checks and address broadcasts)."""
    kwargs = {}
    backend = "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=global_rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def _with_shm(group: AxisGroup, slot_bytes: int, timeout_s: float) -> AxisGroup:
    name = broadcast_text(new_segment_name() if group.rank == 0 else None, src=group.ranks[0], group=group.cpu_group)
    shm = ShmCommunicator(group, slot_bytes, timeout_s, name)
    dist.barrier(group=group.cpu_group)  # every member has mapped it
    shm.attached(name)
    return dataclasses.replace(group, shm=shm)


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
