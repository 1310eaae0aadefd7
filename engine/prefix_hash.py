"""The identity of a full KV block for prefix caching: a hash chained over the blocks before
it. Plain Python.

    root   = sha256("meshserve-kv-v1", what shapes the KV (the cache kind), the request's salt, its LoRA adapter)
    hash_i = sha256(hash_{i-1}, the block's token ids as uint32)

Two blocks with the same hash hold the K/V of the same tokens at the same positions after
the same prefix, computed by the same kind of cache, for requests with the same salt, so
one can stand for the other. SHA-256, as vLLM offers: a collision would hand one request
another's K/V (wrong output at best, another tenant's prompt leaking into it at worst), so
the hash must not collide in practice even for prompts chosen to make it collide; Python's
hash() is 64 bits and not collision-resistant. Hashing a block's ids costs far less than
computing the block. The hashes never leave the driver's process.
"""

from __future__ import annotations

import hashlib
from array import array


def root_hash(cache_kind: str, salt: str | None, adapter: str | None = None) -> bytes:
    """The parent of a sequence's first block. `adapter`: the key of the LoRA adapter the
    sequence runs with, which changes every layer's K and V after the first."""
    h = hashlib.sha256(b"meshserve-kv-v1\0")
    h.update(cache_kind.encode() + b"\0")
    if salt is not None:
        h.update(b"salt\0" + salt.encode() + b"\0")
    if adapter is not None:
        h.update(b"lora\0" + adapter.encode())
    return h.digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("I", token_ids).tobytes()).digest()


def extend_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, root: bytes) -> list[bytes]:
    """`hashes` (those of the first blocks of `token_ids`) extended to every full block."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(block_hash(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
