"""Paged KV-cache blocks: reference counts, each sequence's block table, and the prefix
cache. Plain Python.

Every block is in exactly one of three states:
- in use: in at least one block table (its reference count);
- free: in no block table and holding nothing worth keeping;
- evictable: in no block table, but full and hashed (meshserve.engine.prefix_hash), so a
  later request with the same prefix takes it instead of computing it again.

A sequence's full blocks are hashed and registered as soon as a step is scheduled to fill
them (prompt and output alike, so a preempted sequence finds its own blocks again). A
request admitted in that same step can already start from them: every layer of every
backend stores the step's K/V before any of its attention reads the cache, and later steps
run after it on every rank. So requests that arrive together with a shared system prompt
compute it once. Released blocks
go to the back of the evictable queue, the last block of a sequence first, and are
evicted from the front (least recently used) only when no free block is left. A partial
block is never shared: a request that finds all its tokens cached still computes its last
token (for the logits), in a block of its own.

Context parallelism stripes a sequence's tokens over the ranks by position alone
(meshserve.parallel.context), under one block table whose entry j holds positions
[j * cp * block_size, (j + 1) * cp * block_size), block_size of them on each rank. The
prefix cache's unit is then one table entry: cp * block_size tokens, hashed as one block.
A cached prefix lies on the ranks exactly as a fresh prefill would lay it.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from meshserve.engine.prefix_hash import extend_hashes, root_hash
from meshserve.engine.sequence import Sequence
from meshserve.parallel.context import local_lens_of


class BlockManager:
    """Owns the block ids [0, num_blocks).

    With context parallelism (cp_size > 1) each rank stores only its share of a
    sequence's tokens, under the same block table: a sequence needs blocks for the
    largest share (meshserve.parallel.context says which rank holds which token)."""

    def __init__(self, num_blocks: int, block_size: int, cp_size: int = 1, prefix_caching: bool = False,
                 cache_kind: str = "auto"):
        """`cache_kind`: what shapes the KV beyond the tokens (e.g. "int8"), part of every hash."""
        self.num_blocks, self.block_size, self.cp_size = num_blocks, block_size, cp_size
        self.unit = block_size * cp_size
        """Tokens of one block-table entry (over all the ranks of a context-parallel group)."""
        self.prefix_caching = prefix_caching
        self.cache_kind = cache_kind
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.query_tokens = 0
        """Prompt tokens looked up in the prefix cache at admission (vLLM's prefix_cache_queries)."""
        self.hit_tokens = 0
        """Of those, the tokens found cached (prefix_cache_hits)."""

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now: free or evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def held_after(self, seq: Sequence, num_new: int) -> int:
        """Tokens of `seq` on its fullest rank once `num_new` more are computed."""
        return self.held_after_tokens(seq.num_computed + num_new)

    def held_after_tokens(self, num_tokens: int) -> int:
        """Tokens of a sequence's first `num_tokens` on its fullest rank."""
        if self.cp_size == 1:
            return num_tokens
        return local_lens_of(num_tokens, self.cp_size, self.block_size)[0]

    # ------------------------------------------------------------------ the prefix cache

    def _hashes(self, seq: Sequence) -> list[bytes]:
        if seq.hash_root is None:
            seq.hash_root = root_hash(self.cache_kind, seq.cache_salt, seq.lora.key if seq.lora is not None else None)
        return extend_hashes(seq.block_hashes, seq.token_ids, self.unit, seq.hash_root)

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` (waiting, holding none) can start from: the longest chain of
        its full blocks found in the cache, short of its last token."""
        if not self.prefix_caching:
            return []
        found = []
        for h in self._hashes(seq)[:(seq.num_tokens - 1) // self.unit]:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def can_admit(self, seq: Sequence, cached: list[int], num_new: int) -> bool:
        """Whether `seq` fits when it starts from `cached` (match) and computes `num_new`."""
        need = self.blocks_for(self.held_after_tokens(len(cached) * self.unit + num_new)) - len(cached)
        revived = sum(1 for b in cached if self._refs[b] == 0)  # taken out of the evictable queue
        return need <= self.num_free - revived

    def admit(self, seq: Sequence, cached: list[int], num_new: int, register: bool = True) -> None:
        """Give `seq` the blocks `cached` (its computed prefix) and room for `num_new` more.
        `register=False`: the new blocks join the prefix cache only once `register` says
        their KV is there (it arrives from another replica, not from a step)."""
        assert not seq.block_ids and seq.num_computed == 0, f"seq {seq.seq_id} already holds blocks"
        for b in cached:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        seq.block_ids = list(cached)
        seq.num_computed = seq.num_registered = len(cached) * self.unit
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(seq.num_computed, seq.prompt_len)
        if self.prefix_caching:
            self.query_tokens += seq.num_tokens
            self.hit_tokens += seq.num_computed
        self.grow(seq, num_new, register)

    def _register(self, seq: Sequence, upto: int) -> None:
        """Put `seq`'s full blocks among its first `upto` tokens (those computed once the step
        being scheduled has run) in the cache; a block whose hash is already there, with the
        same contents, stays outside it and is freed when released."""
        full = upto // self.unit
        if full * self.unit <= seq.num_registered:
            return
        hashes = self._hashes(seq)
        for i in range(seq.num_registered // self.unit, full):
            block = seq.block_ids[i]
            if hashes[i] not in self._block_of and block not in self._hash_of:
                self._block_of[hashes[i]] = block
                self._hash_of[block] = hashes[i]
        seq.num_registered = full * self.unit

    def register(self, seq: Sequence) -> None:
        """Offer `seq`'s full computed blocks of known tokens to the prefix cache (after
        `admit(register=False)`, and as an overlapped step's pending tokens become known)."""
        if self.prefix_caching:
            self._register(seq, min(seq.num_computed, seq.num_tokens))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block; returns how many. Safe while requests run: the blocks
        in use stay where they are, they are only no longer found (nor kept once released)."""
        dropped = len(self._hash_of)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        return dropped

    # ------------------------------------------------------------------ allocation

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def computed(self, seq: Sequence, num_new: int) -> None:
        """Record that `num_new` more tokens of `seq` are in the cache."""
        seq.num_computed += num_new

    def extra_blocks(self, seq: Sequence, num_new: int) -> int:
        """Blocks `seq` still needs to hold its computed tokens plus `num_new` more."""
        return max(0, self.blocks_for(self.held_after(seq, num_new)) - len(seq.block_ids))

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        return self.extra_blocks(seq, num_new) <= self.num_free

    def grow(self, seq: Sequence, num_new: int, register: bool = True) -> None:
        n = self.extra_blocks(seq, num_new)
        if n > self.num_free:
            raise RuntimeError(f"seq {seq.seq_id} needs {n} blocks, {self.num_free} free")
        seq.block_ids.extend(self._take() for _ in range(n))
        if self.prefix_caching and register:  # a draft token (speculative decoding) is not known yet: never cached
            self._register(seq, min(seq.num_computed + num_new, seq.num_tokens))

    def trim(self, seq: Sequence) -> int:
        """Give back the blocks past those holding `seq`'s computed tokens (the ones only its
        rejected draft tokens used); returns how many."""
        keep = self.blocks_for(self.held_after(seq, 0))
        extra = seq.block_ids[keep:]
        for b in reversed(extra):
            assert b not in self._hash_of, f"block {b} of rejected drafts is in the prefix cache"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.appendleft(b)
        del seq.block_ids[keep:]
        return len(extra)

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references (last block first); its cache is empty again."""
        for b in reversed(seq.block_ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        seq.block_ids = []
        seq.num_computed = seq.num_registered = 0
