"""Causal attention over keys spread across the context-parallel group.

`attend` is the single-rank building block: exact causal attention of queries over keys
whose positions are known, returning the output and its log-sum-exp (LSE), computed
flash-style (tiles of queries; keys no later than a tile's first query need no mask,
keys later than its last query are skipped). Partial results over disjoint key sets
combine exactly with `merge` (the numerically stable LSE update).

`ring_attention` (pass-KV): each rank attends its queries to the K/V it holds while that
block travels on to the next rank and the previous rank's block arrives (batched
isend/irecv, so communication overlaps compute); after cp steps every query has seen
every key. `merge_over_cp` combines partial outputs of replicated queries (decode).
"""

from __future__ import annotations

import time
from bisect import bisect_right

import torch
import torch.distributed as dist

from meshserve.comm.groups import AxisGroup

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

QUERY_TILE = 512


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """[start, end) row ranges of consecutive positions."""
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


def _flash_part(q, k, v, scale, mask=None):
    # q: (T, H, D), k/v: (L, Hkv, D) -> out (T, H, D) float32, lse (T, H)
    out, lse = _flash(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                      v.transpose(0, 1).unsqueeze(0), 0.0, False, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1).float(), lse[0].transpose(0, 1)


def flash_part(q, k, v, scale, q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None):
    """Attention with LSE over one block of keys, on CPU: every key, or with positions
    (query i sees key j iff q_pos[i] >= k_pos[j]). q: (T, H, D), k/v: (L, Hkv, D) ->
    out (T, H, D) float32, lse (T, H); a row that sees no key has lse -inf.
    `attend` takes any function of this signature (a kernel backend's, on GPU)."""
    if q_pos is None:
        return _flash_part(q, k, v, scale)
    visible = q_pos[:, None] >= k_pos[None, :]
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    o, l = _flash_part(q, k, v, scale, mask)
    # a row that sees none of these keys comes back as out 0, lse 0: make it "no key"
    return o, l.masked_fill(~visible.any(dim=-1, keepdim=True), float("-inf"))


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets, from the two partial results.
    out: (..., D) float32, lse: (...); an lse of -inf means "no key seen"."""
    if out_a is None:
        return out_b, lse_b
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


def attend(q: torch.Tensor, q_pos: list[int], k: torch.Tensor, v: torch.Tensor, k_pos: list[int],
           scale: float, part=flash_part) -> tuple[torch.Tensor, torch.Tensor]:
    """Query i attends key j iff q_pos[i] >= k_pos[j]. Positions ascend in both lists.
    q: (Lq, H, D); k, v: (Lk, Hkv, D). Returns out (Lq, H, D) float32 and lse (Lq, H).
    `part` computes each tile (see flash_part)."""
    heads, dim = q.shape[1], q.shape[2]
    out = torch.zeros(len(q_pos), heads, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((len(q_pos), heads), float("-inf"), dtype=torch.float32, device=q.device)
    for run_start, run_end in _runs(q_pos):
        for a in range(run_start, run_end, QUERY_TILE):
            b = min(a + QUERY_TILE, run_end)
            first, last = q_pos[a], q_pos[b - 1]
            seen = bisect_right(k_pos, first)  # keys every query of the tile sees
            partial = bisect_right(k_pos, last)  # keys some query of the tile sees
            tile_out, tile_lse = None, None
            if seen:
                tile_out, tile_lse = part(q[a:b], k[:seen], v[:seen], scale)
            if partial > seen:
                qp = torch.tensor(q_pos[a:b], device=q.device)
                kp = torch.tensor(k_pos[seen:partial], device=q.device)
                o, l = part(q[a:b], k[seen:partial], v[seen:partial], scale, qp, kp)
                tile_out, tile_lse = merge(tile_out, tile_lse, o, l)
            if tile_out is not None:
                out[a:b], lse[a:b] = tile_out, tile_lse
    return out, lse


def ring_attention(q: torch.Tensor, q_pos: list[int], k: torch.Tensor, v: torch.Tensor, k_pos: list[int],
                   peer_lens: list[int], cp: AxisGroup, scale: float,
                   part=flash_part) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the keys of every rank of `cp`.

    Sends this rank's (k, v, positions) around the ring with batched isend/irecv while
    computing on the block at hand. `peer_lens[r]`: how many keys rank r holds (each
    rank knows them all, so receive buffers are sized exactly). Returns out (Lq, H, D)
    float32 and lse (Lq, H). `part`: as in `attend`."""
    block = (k, v, torch.tensor(k_pos, dtype=torch.long, device=k.device))
    out, lse = None, None
    for step in range(cp.size):
        works = []
        if step < cp.size - 1:
            n = peer_lens[(cp.rank - step - 1) % cp.size]
            incoming = (k.new_empty((n, *k.shape[1:])), v.new_empty((n, *v.shape[1:])),
                        torch.empty(n, dtype=torch.long, device=k.device))
            # the time this rank posts, so the receiver can tell a slow transfer from a late sender
            posted = torch.tensor([time.monotonic_ns()], dtype=torch.long)
            peer_posted = torch.empty(1, dtype=torch.long)
            ops = [dist.P2POp(dist.isend, t.contiguous(), cp.next_rank, cp.device_group) for t in (*block, posted)]
            ops += [dist.P2POp(dist.irecv, t, cp.prev_rank, cp.device_group) for t in (*incoming, peer_posted)]
            works = dist.batch_isend_irecv(ops)
        if len(block[2]):
            o, l = attend(q, q_pos, block[0], block[1], block[2].tolist(), scale, part)
            out, lse = merge(out, lse, o, l)
        if works:
            computed = time.monotonic_ns()
            started = cp.timer.start()
            for w in works:
                w.wait()
            cp.timer.stop(started)
            transfer_began = max(int(posted), int(peer_posted))
            cp.timer.exposed_seconds += max(0, time.monotonic_ns() - max(computed, transfer_began)) / 1e9
            block = incoming
    return out, lse


def merge_over_cp(out: torch.Tensor, lse: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """Combines partial attention of the same (replicated) queries over each rank's keys.

    All-gathers out (N, H, D) float32 and lse (N, H) over `cp`; returns the merged out."""
    if cp.size == 1:
        return out
    outs = [torch.empty_like(out) for _ in range(cp.size)]
    lses = [torch.empty_like(lse) for _ in range(cp.size)]
    started = cp.timer.start()
    dist.all_gather(outs, out.contiguous(), group=cp.device_group)
    dist.all_gather(lses, lse.contiguous(), group=cp.device_group)
    cp.timer.stop(started)
    lse_all = torch.stack(lses)  # (cp, N, H)
    weights = torch.exp(lse_all - lse_all.max(dim=0).values).nan_to_num(0.0)
    merged = (torch.stack(outs) * weights.unsqueeze(-1)).sum(dim=0)
    return merged / weights.sum(dim=0).unsqueeze(-1)
