"""Slots of a pool of rows kept between steps (the sampler's state, the block tables): a
key's slot is reused once freed, and the pool doubles when full (its owner then grows its
arrays to `size`)."""

from __future__ import annotations

INITIAL_SLOTS = 16


class SlotPool:
    def __init__(self, size: int = 0) -> None:
        self.of: dict[int, int] = {}
        self._free = list(range(size - 1, -1, -1))
        self.size = size

    def take(self, key: int) -> tuple[int, bool]:
        """`key`'s new slot, and whether the pool grew (the owner's arrays must reach `size`)."""
        grew = False
        if not self._free:
            old = self.size
            self.size = max(INITIAL_SLOTS, 2 * old)
            self._free = list(range(self.size - 1, old - 1, -1))
            grew = True
        slot = self._free.pop()
        self.of[key] = slot
        return slot, grew

    def drop(self, key: int) -> bool:
        """Free `key`'s slot; whether it had one."""
        slot = self.of.pop(key, None)
        if slot is not None:
            self._free.append(slot)
        return slot is not None
