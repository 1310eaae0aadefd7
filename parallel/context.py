"""Which context-parallel rank holds which token of a sequence, and what each rank
computes of a chunk. Plain Python: the driver (block allocation) and every rank (its
share of the batch) compute the same.

A chunk of at least 2 * cp tokens (a prefill, or a prefill chunk) is cut into 2 * cp
segments of (nearly) equal length and rank r takes segments r and 2*cp - 1 - r: under a
causal mask an early segment attends to little and a late one to much, so the head-tail
pair gives every rank the same attention work (the "zigzag" split of ring attention).
A shorter chunk (a decode step) goes token by token to the rank that holds the fewest
tokens of the sequence (the lowest such rank), so the shards stay balanced.

Every rank stores the K/V of its tokens in position order, densely: the k-th token a rank
holds sits at local index k of that rank's paged cache, under a block table all ranks
of the group share (each rank's cache is its own memory).
"""

from __future__ import annotations

from dataclasses import dataclass


def segment_bounds(length: int, segments: int) -> list[tuple[int, int]]:
    """[start, end) offsets of `segments` nearly equal parts of `length` (the first ones
    one longer when it does not divide)."""
    base, extra = divmod(length, segments)
    bounds, start = [], 0
    for i in range(segments):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def is_split(length: int, cp_size: int) -> bool:
    """A chunk this long is divided among the ranks (else every rank computes all of it)."""
    return cp_size > 1 and length >= 2 * cp_size


def chunk_owners(local_lens: list[int], length: int) -> list[int]:
    """The rank that stores each of a chunk's tokens, in position order. `local_lens`:
    tokens each rank holds before the chunk."""
    cp = len(local_lens)
    if cp == 1:
        return [0] * length
    if is_split(length, cp):
        owners = [0] * length
        for seg, (a, b) in enumerate(segment_bounds(length, 2 * cp)):
            rank = seg if seg < cp else 2 * cp - 1 - seg
            owners[a:b] = [rank] * (b - a)
        return owners
    held = list(local_lens)
    owners = []
    for _ in range(length):
        rank = min(range(cp), key=lambda r: (held[r], r))
        owners.append(rank)
        held[rank] += 1
    return owners


def advance(local_lens: list[int], owners: list[int]) -> list[int]:
    """Tokens each rank holds after storing a chunk with these owners."""
    out = list(local_lens)
    for r in owners:
        out[r] += 1
    return out


def local_lens_of(chunks: list[int], cp_size: int) -> list[int]:
    """Tokens each rank holds after a sequence was computed in chunks of these lengths."""
    lens = [0] * cp_size
    for n in chunks:
        lens = advance(lens, chunk_owners(lens, n))
    return lens


def owned_positions(start: int, owners: list[int], rank: int) -> list[int]:
    """Positions of a chunk beginning at `start` whose K/V `rank` stores, ascending."""
    return [start + i for i, owner in enumerate(owners) if owner == rank]


@dataclass(frozen=True)
class RankShare:
    """What one rank does with one chunk of a sequence."""

    split: bool
    """True: the chunk is divided (each rank computes its own tokens); False: every rank
    computes all of it and stores only its own."""
    queries: list[int]
    """Positions this rank computes, in row order."""
    stored: list[int]
    """Positions whose K/V this rank stores, ascending."""
    stored_rows: list[int]
    """Indices into `queries` of the stored positions."""


def rank_share(start: int, owners: list[int], rank: int, cp_size: int) -> RankShare:
    """`rank`'s share of a chunk beginning at `start` with these owners (chunk_owners)."""
    stored = owned_positions(start, owners, rank)
    if is_split(len(owners), cp_size):
        return RankShare(True, stored, stored, list(range(len(stored))))
    return RankShare(False, list(range(start, start + len(owners))), stored, [p - start for p in stored])
