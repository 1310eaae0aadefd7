"""torch.distributed wrappers named for what they do to the data (Megatron's mappings).

Each takes the AxisGroup to communicate over; on a group of one it is the identity and
touches no process group, so single-rank runs need no torch.distributed at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshserve.comm.groups import AxisGroup


def reduce_from_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """All-reduces (sums) `x` over `group`, in place; returns it."""
    if group.size > 1:
        started = group.timer.start()
        if group.shm is not None and group.shm.fits(x):
            group.shm.all_reduce(x)
        else:
            dist.all_reduce(x, group=group.device_group)
        group.timer.stop(started)
    return x


def gather_from_tp(x: torch.Tensor, group: AxisGroup, dst: int = 0) -> torch.Tensor | None:
    """Gathers `x` from every member to member `dst`, concatenated along the last dim.

    Returns the concatenation on `dst` and None elsewhere."""
    if group.size == 1:
        return x
    x = x.contiguous()
    started = group.timer.start()
    if group.shm is not None and group.shm.fits(x):
        out = group.shm.gather(x, dst)
    else:
        is_dst = group.rank == dst
        parts = [torch.empty_like(x) for _ in range(group.size)] if is_dst else None
        dist.gather(x, parts, dst=group.ranks[dst], group=group.device_group)
        out = torch.cat(parts, dim=-1) if is_dst else None
    group.timer.stop(started)
    return out


def broadcast_from_tp(x: torch.Tensor, group: AxisGroup, src: int = 0) -> torch.Tensor:
    """Member `src`'s `x` into every member's `x` (same shape and dtype), in place; returns it."""
    if group.size > 1:
        started = group.timer.start()
        dist.broadcast(x, src=group.ranks[src], group=group.device_group)
        group.timer.stop(started)
    return x


def send_to_next_stage(x: torch.Tensor, group: AxisGroup) -> list:
    """Sends `x` to the next pipeline stage (batched isend); returns the pending works,
    which must be waited on before `x` is reused or freed."""
    started = group.timer.start()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x.contiguous(), group.next_rank, group.device_group)])
    group.timer.stop(started)
    return works


def recv_from_prev_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                         group: AxisGroup) -> torch.Tensor:
    """Receives a tensor of `shape` from the previous pipeline stage (sizes come from the
    step plan, which every rank has)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    started = group.timer.start()
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, group.prev_rank, group.device_group)]):
        work.wait()
    group.timer.stop(started)
    return x


def max_over_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """All-reduces `x` over `group` by elementwise maximum, in place; returns it."""
    if group.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group.device_group)
    return x


def all_to_all_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: AxisGroup) -> torch.Tensor:
    """All-to-all over `group` along dim 0: the first `send_counts[0]` rows of `x` go to
    member 0, the next `send_counts[1]` to member 1, ...; returns the rows received,
    member 0's first (`recv_counts` of them each)."""
    if group.size == 1:
        return x
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    started = group.timer.start()
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group.device_group)
    group.timer.stop(started)
    return out


def _padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` contiguous with zero rows after its own up to `rows`: the equal shares that
    all_gather_single and reduce_scatter_single exchange."""
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def all_gather_rows(x: torch.Tensor, counts: list[int], group: AxisGroup) -> torch.Tensor:
    """All-gathers along dim 0 over `group`: member i contributes its `counts[i]` rows (x);
    returns them all, member 0's first, on every member. Where only the last member's count
    is short (sequence parallelism's rows), the result is a view of the gathered buffer."""
    if group.size == 1:
        return x
    started = group.timer.start()
    width = max(counts)
    if group.shm is not None and group.shm.fits(x, width):
        out = group.shm.all_gather_rows(x, counts)
    else:
        gathered = x.new_empty((group.size * width, *x.shape[1:]))
        dist.all_gather_single(gathered, _padded_rows(x, width), group=group.device_group)
        if all(n == width for n in counts[:-1]):
            out = gathered[:sum(counts)]
        else:
            out = torch.cat([gathered[i * width:i * width + n] for i, n in enumerate(counts)])
    group.timer.stop(started)
    return out


def reduce_scatter_rows(x: torch.Tensor, counts: list[int], group: AxisGroup) -> torch.Tensor:
    """Sums `x` (every member's has the same shape) over `group` and returns this member's
    rows of the sum: member i's are the `counts[i]` after those of members before it.
    `counts` are equal but perhaps the last, which may be short (sequence parallelism's)."""
    if group.size == 1:
        return x
    started = group.timer.start()
    start = sum(counts[:group.rank])
    if group.shm is not None and group.shm.fits(x):
        out = group.shm.reduce_scatter_rows(x, start, counts[group.rank])
    else:
        width = counts[0]
        out = x.new_empty((width, *x.shape[1:]))
        dist.reduce_scatter_single(out, _padded_rows(x, width * group.size), group=group.device_group)
        out = out[:counts[group.rank]]
    group.timer.stop(started)
    return out
