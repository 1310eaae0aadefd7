"""Paged KV-cache blocks: a free list and each sequence's block table. Plain Python."""

from __future__ import annotations

from collections import deque

from meshserve.engine.sequence import Sequence


class BlockManager:
    """Owns the block ids [0, num_blocks). A block is either free or in exactly one
    sequence's block table (prefix sharing would add reference counts)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, num_new: int) -> int:
        """Blocks `seq` still needs to hold its computed tokens plus `num_new` more."""
        return max(0, self.blocks_for(seq.num_computed + num_new) - len(seq.block_ids))

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        return self.extra_blocks(seq, num_new) <= len(self._free)

    def grow(self, seq: Sequence, num_new: int) -> None:
        n = self.extra_blocks(seq, num_new)
        if n > len(self._free):
            raise RuntimeError(f"seq {seq.seq_id} needs {n} blocks, {len(self._free)} free")
        seq.block_ids.extend(self._free.popleft() for _ in range(n))

    def release(self, seq: Sequence) -> None:
        self._free.extend(seq.block_ids)
        seq.block_ids = []
