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

import datetime
from typing import Protocol

import torch
import torch.distributed as dist


class Pending(Protocol):
    def wait(self) -> None:
        """Until the tensor is sent (it may be reused) or received (it may be read); raises
        if the transfer failed or timed out."""


class KvTransport(Protocol):
    def send(self, peer: str, tag: int, tensor: torch.Tensor) -> Pending: ...

    def recv(self, peer: str, tag: int, tensor: torch.Tensor) -> Pending: ...

    def close(self) -> None: ...


class TorchKvTransport:
    def __init__(self, name: str, store: dist.Store, timeout_s: float = 60.0, interface: str | None = None):
        """`name`: this rank's name among the transport's peers (e.g. "replica0/rank1").
        `interface`: the network interface the pairs' sockets use (cluster.interface;
        default: the host name's address)."""
        self.name, self.store = name, store
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.interface = interface
        self._groups: dict[str, tuple[dist.ProcessGroup, int]] = {}

    def connect(self, peer: str) -> None:
        """Make the 2-rank group with `peer` (blocks until `peer` connects to this rank too)."""
        if peer in self._groups:
            return
        first, second = sorted((self.name, peer))
        rank = 0 if self.name == first else 1
        prefix = dist.PrefixStore(f"kv/{first}|{second}", self.store)
        if self.interface:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(interface=self.interface)]
            options._timeout = self.timeout
            group = dist.ProcessGroupGloo(prefix, rank, 2, options)
        else:
            group = dist.ProcessGroupGloo(prefix, rank, 2, self.timeout)
        self._groups[peer] = (group, 1 - rank)

    def send(self, peer: str, tag: int, tensor: torch.Tensor) -> Pending:
        self.connect(peer)
        group, other = self._groups[peer]
        return group.send([tensor], other, tag)

    def recv(self, peer: str, tag: int, tensor: torch.Tensor) -> Pending:
        self.connect(peer)
        group, other = self._groups[peer]
        return group.recv([tensor], other, tag)

    def drop(self, peer: str) -> None:
        """Forget the group with `peer` (after a failure: the next transfer makes a new one)."""
        self._groups.pop(peer, None)

    def close(self) -> None:
        self._groups.clear()


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
