"""What the front door believes one replica's prefix cache holds: the chained hashes
(engine/prefix_hash.py) of the full blocks of the token sequences it sent there, least
recently used forgotten beyond the replica's cache size. Plain Python.

An estimate, as SGLang's router keeps one: the replica may have evicted blocks sooner (its
running requests hold blocks too) or still hold some forgotten here. A wrong guess costs a
prefill, never a wrong token: the replica's own cache decides what is reused.
"""

from __future__ import annotations

from collections import OrderedDict

from meshserve.engine.prefix_hash import extend_hashes, root_hash

ROUTER_CACHE_KIND = "router"
"""The root's cache kind: these hashes are compared only with each other."""


def prefix_hashes(token_ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """The chained hash of every full block of `token_ids` (requests with different salts
    never share a prefix)."""
    return extend_hashes([], token_ids, block_size, root_hash(ROUTER_CACHE_KIND, salt))


class PrefixIndex:
    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` the replica holds."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        """The replica computed (or reused) these blocks just now."""
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
