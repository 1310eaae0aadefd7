"""Paged KV-cache blocks: a free list and each sequence's block table. Plain Python."""

from __future__ import annotations

from collections import deque

from meshserve.engine.sequence import Sequence
from meshserve.parallel.context import advance, chunk_owners


class BlockManager:
    """Owns the block ids [0, num_blocks). A block is either free or in exactly one
    sequence's block table (prefix sharing would add reference counts).

    With context parallelism (cp_size > 1) each rank stores only its share of a
    sequence's tokens, under the same block table: a sequence needs blocks for the
    largest share (meshserve.parallel.context says which rank holds which token)."""

    def __init__(self, num_blocks: int, block_size: int, cp_size: int = 1):
        self.num_blocks, self.block_size, self.cp_size = num_blocks, block_size, cp_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def held_after(self, seq: Sequence, num_new: int) -> int:
        """Tokens of `seq` on its fullest rank once `num_new` more are computed."""
        if self.cp_size == 1:
            return seq.num_computed + num_new
        return max(advance(seq.cp_local_lens, chunk_owners(seq.cp_local_lens, num_new)))

    def computed(self, seq: Sequence, num_new: int) -> None:
        """Record that `num_new` more tokens of `seq` are in the cache."""
        if self.cp_size > 1:
            seq.cp_local_lens = advance(seq.cp_local_lens, chunk_owners(seq.cp_local_lens, num_new))
        seq.num_computed += num_new

    def extra_blocks(self, seq: Sequence, num_new: int) -> int:
        """Blocks `seq` still needs to hold its computed tokens plus `num_new` more."""
        return max(0, self.blocks_for(self.held_after(seq, num_new)) - len(seq.block_ids))

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        return self.extra_blocks(seq, num_new) <= len(self._free)

    def grow(self, seq: Sequence, num_new: int) -> None:
        n = self.extra_blocks(seq, num_new)
        if n > len(self._free):
            raise RuntimeError(f"seq {seq.seq_id} needs {n} blocks, {len(self._free)} free")
        seq.block_ids.extend(self._free.popleft() for _ in range(n))

    def release(self, seq: Sequence) -> None:
        """Free the blocks of `seq`; its cache is empty again."""
        self._free.extend(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.cp_local_lens = [0] * self.cp_size
