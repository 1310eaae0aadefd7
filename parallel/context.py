"""Which context-parallel rank holds which token of a sequence, and what each rank
computes of a chunk. Plain Python: the driver (block allocation) and every rank (its
share of the batch) compute the same.

Tokens are striped over the ranks by KV block: position p belongs to rank
(p // block_size) % cp. Who holds a token depends on its position alone, never on how the
sequence was chunked, so the K/V of a prefix is laid out the same whichever request
computed it, in one chunk or many: that is what lets a cached prefix be reused under
context parallelism (meshserve.engine.block_manager). Each rank takes every cp-th block of
a long chunk, so under a causal mask the ranks' attention work differs by at most about a
block's worth per cp blocks (the head-tail "zigzag" split would balance a single chunk
exactly, but lays out the same prefix differently for different chunkings).

Every rank stores the K/V of its tokens in position order, densely: the k-th token a rank
holds sits at local index k of that rank's paged cache, under a block table all ranks of
the group share (each rank's cache is its own memory). Entry j of the table holds, on rank
r, global block j * cp + r: one table entry covers cp * block_size consecutive positions.
"""

from __future__ import annotations

from dataclasses import dataclass


def owner_of(position: int, cp_size: int, block_size: int) -> int:
    return (position // block_size) % cp_size


def chunk_owners(start: int, length: int, cp_size: int, block_size: int) -> list[int]:
    """The rank that stores each token of the chunk [start, start + length), in position order."""
    return [owner_of(p, cp_size, block_size) for p in range(start, start + length)]


def is_split(owners: list[int], cp_size: int) -> bool:
    """A chunk with these owners is divided among the ranks (each computes its own tokens)
    when every rank owns some of it; else every rank computes all of it (a decode token, a
    chunk within one block) and stores only its own."""
    return cp_size > 1 and len(set(owners)) == cp_size


def advance(local_lens: list[int], owners: list[int]) -> list[int]:
    """Tokens each rank holds after storing a chunk with these owners."""
    out = list(local_lens)
    for r in owners:
        out[r] += 1
    return out


def local_lens_of(num_tokens: int, cp_size: int, block_size: int) -> list[int]:
    """Tokens each rank holds of a sequence's first `num_tokens` (rank 0 the most)."""
    cycles, rest = divmod(num_tokens, cp_size * block_size)
    return [cycles * block_size + min(block_size, max(0, rest - r * block_size)) for r in range(cp_size)]


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
    if is_split(owners, cp_size):
        return RankShare(True, stored, stored, list(range(len(stored))))
    return RankShare(False, list(range(start, start + len(owners))), stored, [p - start for p in stored])
