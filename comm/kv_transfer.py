"""Moving KV-cache blocks from one replica's rank to another's (disaggregated prefill and
decode): the interface the engine uses, and its torch.distributed implementation.

A prefill rank and the decode rank that holds the same shard (same tensor, pipeline and
context coordinates, in another replica) exchange one sequence's blocks layer by layer: the
sender gathers the layer's blocks into one contiguous tensor and sends it as soon as the
layer is written; the receiver lands it in a staging tensor and scatters it into its own
blocks (which have other ids). Each message carries a tag, unique per (transfer, layer),
so transfers of several sequences may be in flight at once and arrive in any order.

`TorchKvTransport` runs a 2-rank process group per peer, outside any replica's world (each
replica is a torch.distributed world of its own): gloo on CPU, NCCL would be the same with
CUDA tensors. The groups meet through a key-value store (the front door's TCPStore). Another
transport (NIXL, Mooncake) implements the same three calls.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import uuid
from typing import Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class Pending(Protocol):
    def wait(self) -> None:
        """Until the tensor is sent (it may be reused) or received (it may be read); raises
        if the transfer failed or timed out."""


class KvTransport(Protocol):
    def send(self, peer: str, tag: int, tensor: torch.Tensor) -> Pending: ...

    def recv(self, peer: str, tag: int, tensor: torch.Tensor) -> Pending: ...

    def close(self) -> None: ...


WATCH_S = 0.5
"""How often a rank looks for peers that started again."""


class TorchKvTransport:
    def __init__(self, name: str, store: dist.Store, timeout_s: float = 60.0, interface: str | None = None):
        """`name`: this rank's name among the transport's peers (e.g. "replica0/rank1").
        `interface`: the network interface the pairs' sockets use (cluster.interface;
        default: the host name's address). Each start of a rank draws a nonce, published
        in the store under its name: a pair's group is met under both ends' nonces, so a
        restarted peer pairs anew (watch) where its last group is dead."""
        self.name, self.store = name, store
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.interface = interface
        self.nonce = uuid.uuid4().hex[:16]
        store.set(_nonce_key(name), self.nonce)
        self._groups: dict[str, tuple[dist.ProcessGroup, int, str]] = {}
        self._retired: list[dist.ProcessGroup] = []
        """Groups of peers that started again: kept, as tearing down a group whose other end
        died may block."""
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    def connect(self, peer: str) -> None:
        """Make the 2-rank group with `peer` (blocks until `peer` connects to this rank too)."""
        if peer in self._groups:
            return
        self._groups[peer] = self._pair(peer, self.store.get(_nonce_key(peer)).decode())

    def _pair(self, peer: str, nonce: str) -> tuple[dist.ProcessGroup, int, str]:
        (first, first_nonce), (second, second_nonce) = sorted(((self.name, self.nonce), (peer, nonce)))
        rank = 0 if self.name == first else 1
        prefix = dist.PrefixStore(f"kv/{first}#{first_nonce}|{second}#{second_nonce}", self.store)
        if self.interface:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(interface=self.interface)]
            options._timeout = self.timeout
            group = dist.ProcessGroupGloo(prefix, rank, 2, options)
        else:
            group = dist.ProcessGroupGloo(prefix, rank, 2, self.timeout)
        return group, 1 - rank, nonce

    def watch(self, peers: list[str], every_s: float = WATCH_S) -> None:
        """On a thread of its own: pair again with any of `peers` that started again (its
        nonce changed), so a replica restarted after a failure finds its partners; the
        transfers meanwhile fail with the dead group, each alone."""

        def run() -> None:
            while not self._closing.wait(every_s):
                for peer in peers:
                    try:
                        if not self.store.check([_nonce_key(peer)]):
                            continue
                        nonce = self.store.get(_nonce_key(peer)).decode()
                        current = self._groups.get(peer)
                        if current is not None and current[2] == nonce:
                            continue
                        log.warning("KV transfer: %s started again: pairing %s with it anew", peer, self.name)
                        paired = self._pair(peer, nonce)
                    except Exception as e:  # the store or the peer went away meanwhile: try again later
                        log.warning("KV transfer: pairing %s with %s failed (%s); trying again", self.name, peer, e)
                        continue
                    if current is not None:
                        self._retired.append(current[0])
                    self._groups[peer] = paired

        self._watcher = threading.Thread(target=run, name="meshserve-kv-pairs", daemon=True)
        self._watcher.start()
        atexit.register(self.close)  # a process must not end while the watcher is inside the store's C++

    def send(self, peer: str, tag: int, tensor: torch.Tensor) -> Pending:
        self.connect(peer)
        group, other, _ = self._groups[peer]
        return group.send([tensor], other, tag)

    def recv(self, peer: str, tag: int, tensor: torch.Tensor) -> Pending:
        self.connect(peer)
        group, other, _ = self._groups[peer]
        return group.recv([tensor], other, tag)

    def close(self) -> None:
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join(self.timeout.total_seconds())
        self._groups.clear()


def _nonce_key(name: str) -> str:
    return f"kv/nonce/{name}"


BLOCKS_PER_MESSAGE = 16
"""A transfer's blocks go in messages of up to this many per layer: the first are sent while
a long prompt's later chunks still compute."""


def layer_tag(transfer: int, layer: int, num_layers: int, message: int = 0, max_messages: int = 1) -> int:
    """The tag of `transfer`'s `message` for `layer` (gloo tags are 32-bit here)."""
    return ((transfer * max_messages + message) * num_layers + layer) % (1 << 31)


def message_spans(first_block: int, num_blocks: int) -> list[tuple[int, int]]:
    """The [start, end) block indexes (in the sequence's block table) of each message."""
    end = first_block + num_blocks
    return [(b, min(b + BLOCKS_PER_MESSAGE, end)) for b in range(first_block, end, BLOCKS_PER_MESSAGE)]


def gather_blocks(cache: tuple[torch.Tensor, torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """A layer's K and V blocks `block_ids`, stacked: (2, len(block_ids), block_size, ...)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=cache[0].device)
    return torch.stack([cache[0].index_select(0, index), cache[1].index_select(0, index)])


def scatter_blocks(cache: tuple[torch.Tensor, torch.Tensor], block_ids: list[int], stacked: torch.Tensor) -> None:
    """The inverse of gather_blocks, into this rank's blocks `block_ids`."""
    index = torch.tensor(block_ids, dtype=torch.long, device=cache[0].device)
    cache[0].index_copy_(0, index, stacked[0])
    cache[1].index_copy_(0, index, stacked[1])
