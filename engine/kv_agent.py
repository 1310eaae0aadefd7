"""A rank's side of disaggregated prefill/decode: the KV transfers the driver's plans start,
land and end (comm.messages.KvOps), over a KvTransport (comm/kv_transfer.py).

Prefill rank: a transfer names a sequence and the blocks of its prompt to send. Each step,
the blocks whose tokens are now all computed are due; the model calls `after_layer` as each
layer finishes, and that layer's due blocks are gathered and sent at once, so the transfer
runs while the later layers compute. A background thread waits for the sends to complete.

Decode rank: receives are posted as soon as the blocks are reserved (before the prefill even
starts: a gloo send completes only once its receive is posted). A thread per transfer waits
for them (gloo gives no way to poll a receive, and a wait that times out breaks the pair), so
a transfer that never arrives costs a thread and its staging buffers, not the connection.
To land a transfer, every rank of the replica waits for its own part up to the timeout and
they agree (a MIN all-reduce) whether it arrived whole; only then is it copied into the
sequence's blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from meshserve.comm.kv_transfer import (BLOCKS_PER_MESSAGE, KvTransport, Pending, gather_blocks, layer_tag,
                                        message_spans, scatter_blocks)
from meshserve.comm.messages import KvOps, KvTransfer
from meshserve.engine.mirror import ScheduledChunk

log = logging.getLogger("meshserve")

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class KvStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    send_seconds: float = 0.0
    """Prefill: gathering blocks and posting sends on the step's thread."""
    transfer_seconds: float = 0.0
    """Prefill: from a transfer's first send to its last one's completion, summed."""
    overlapped_seconds: float = 0.0
    """Prefill: of those, the time the steps that computed its blocks still ran."""
    transfers_sent: int = 0
    land_wait_seconds: float = 0.0
    """Decode: steps held waiting for transfers to arrive (what compute did not hide)."""
    transfers_landed: int = 0
    transfers_failed: int = 0


@dataclass
class _Receive:
    transfer: KvTransfer
    staged: list[tuple[int, int, torch.Tensor]]
    """(local layer, message, staging buffer)."""
    posted: float
    done: threading.Event = field(default_factory=threading.Event)
    finished: float = 0.0
    error: str | None = None


@dataclass
class _Send:
    transfer: KvTransfer
    spans: list[tuple[int, int]]
    sent: set[int] = field(default_factory=set)
    first_post: float = 0.0
    compute_end: float = 0.0
    """When the step that sent its last message finished computing (0: not yet)."""
    outstanding: int = 0
    last_done: float = 0.0


class KvAgent:
    def __init__(self, transport: KvTransport, peer_name: Callable[[int], str], caches: list[KVCache],
                 layer_start: int, num_layers: int, block_size: int, max_blocks: int, device: torch.device,
                 world_size: int = 1, timeout: float = 30.0):
        """`peer_name(replica)`: the transport name of the rank with this rank's place in
        that replica. `caches`: this rank's layers' (K, V) caches, layer `layer_start` on;
        `num_layers`: the model's. `max_blocks`: blocks of the longest sequence (tags).
        `world_size`: the replica's ranks, which agree on every landing. `timeout`: how
        long a landing waits for a transfer (disaggregation.transfer_timeout)."""
        self.timeout = timeout
        self.transport, self.peer_name, self.caches = transport, peer_name, caches
        self.layer_start, self.num_layers, self.block_size = layer_start, num_layers, block_size
        self.max_messages = -(-max_blocks // BLOCKS_PER_MESSAGE)
        self.device, self.world_size = device, world_size
        self.stats = KvStats()
        self._receiving: dict[int, _Receive] = {}
        self._sending: dict[int, _Send] = {}
        """By sequence id."""
        self._due: list[tuple[_Send, int, list[int]]] = []
        self._landed: dict[int, bool] = {}
        self._sent: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._complete_sends, name="meshserve-kv-sends", daemon=True).start()

    def _tag(self, transfer: int, layer: int, message: int) -> int:
        return layer_tag(transfer, self.layer_start + layer, self.num_layers, message, self.max_messages)

    def _shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, *self.caches[0][0].shape[1:]) if self.caches else (2, num_blocks)

    # ------------------------------------------------------------------ a plan's ops

    def apply(self, ops: KvOps) -> None:
        """Before the step runs: end, post, register and land what `ops` says."""
        for transfer in ops.end:
            self._end(transfer)
        for transfer in ops.receive:
            self._post(transfer)
        for transfer in ops.send:
            self._sending[transfer.seq_id] = _Send(transfer, message_spans(transfer.first_block, transfer.num_blocks))
        if ops.land:
            self._land(ops.land, self.timeout)

    def take_landed(self) -> dict[int, bool]:
        landed, self._landed = self._landed, {}
        return landed

    def _post(self, transfer: KvTransfer) -> None:
        peer = self.peer_name(transfer.peer)
        dtype = self.caches[0][0].dtype if self.caches else torch.float32
        staged, works = [], []
        for m, (start, end) in enumerate(message_spans(0, transfer.num_blocks)):
            for layer in range(len(self.caches)):
                buffer = torch.empty(self._shape(end - start), dtype=dtype, device=self.device)
                staged.append((layer, m, buffer))
                works.append(self.transport.recv(peer, self._tag(transfer.transfer, layer, m), buffer))
        receive = _Receive(transfer, staged, time.perf_counter())
        self._receiving[transfer.transfer] = receive
        threading.Thread(target=_await, args=(receive, works), name=f"meshserve-kv-{transfer.transfer}",
                         daemon=True).start()

    def _land(self, transfers: list[int], timeout: float) -> None:
        start = time.perf_counter()
        deadline = time.monotonic() + timeout
        ok = []
        for t in transfers:
            receive = self._receiving.get(t)
            arrived = receive is not None and receive.done.wait(max(0.0, deadline - time.monotonic()))
            ok.append(1 if arrived and receive.error is None else 0)
        flags = torch.tensor(ok, dtype=torch.int32, device=self.device)
        if self.world_size > 1:  # every rank lands a transfer, or none does
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        for t, whole in zip(transfers, flags.tolist()):
            receive = self._receiving.pop(t, None)
            self._landed[t] = bool(whole)
            if not whole:
                self.stats.transfers_failed += 1
                why = "not arrived" if receive is None or not receive.done.is_set() else receive.error or "another rank's part"
                log.warning("KV transfer %d from replica %s failed: %s", t,
                            receive.transfer.peer if receive else "?", why)
                continue
            ids = receive.transfer.block_ids
            spans = message_spans(0, receive.transfer.num_blocks)
            for layer, m, buffer in receive.staged:
                scatter_blocks(self.caches[layer], ids[spans[m][0]:spans[m][1]], buffer)
                self.stats.bytes_received += buffer.numel() * buffer.element_size()
            self.stats.transfers_landed += 1
            self.stats.transfer_seconds += receive.finished - receive.posted
        self.stats.land_wait_seconds += time.perf_counter() - start

    def _end(self, transfer: KvTransfer) -> None:
        """Forget `transfer`; a send not finished sends its remaining messages as zeros."""
        if transfer.block_ids:  # a receive: its thread keeps the buffers until they arrive
            self._receiving.pop(transfer.transfer, None)
            return
        if transfer.seq_id >= 0:  # a send this rank knows; none left if it completed
            send = self._sending.pop(transfer.seq_id, None)
            if send is None:
                return
        else:  # a request the prefill replica refused: nothing of it was sent
            send = _Send(transfer, message_spans(transfer.first_block, transfer.num_blocks))
        peer = self.peer_name(transfer.peer)
        dtype = self.caches[0][0].dtype if self.caches else torch.float32
        for m, (start, end) in enumerate(send.spans):
            if m in send.sent:
                continue
            zeros = torch.zeros(self._shape(end - start), dtype=dtype, device=self.device)
            for layer in range(len(self.caches)):
                self._sent.put((None, self.transport.send(peer, self._tag(transfer.transfer, layer, m), zeros), zeros))

    # ------------------------------------------------------------------ sending, in a step

    def due(self, chunks: list[ScheduledChunk]) -> bool:
        """The messages this step completes (all their tokens computed once it ran); whether
        there are any (the model then calls `after_layer`)."""
        self._due = []
        for c in chunks:
            send = self._sending.get(c.seq_id)
            if send is None:
                continue
            computed = c.start + c.num_new
            for m, (start, end) in enumerate(send.spans):
                if m not in send.sent and computed >= min(end * self.block_size, c.seq.prompt_len):
                    self._due.append((send, m, c.seq.block_ids[start:end]))
        return bool(self._due)

    def after_layer(self, layer: int) -> None:
        """Layer `layer` (local) of the step wrote its KV: send its due blocks."""
        start = time.perf_counter()
        for send, m, ids in self._due:
            t = send.transfer
            stacked = gather_blocks(self.caches[layer], ids)
            with self._lock:
                send.first_post = send.first_post or time.perf_counter()
                send.outstanding += 1
            work = self.transport.send(self.peer_name(t.peer), self._tag(t.transfer, layer, m), stacked)
            self._sent.put((send, work, stacked))
            self.stats.bytes_sent += stacked.numel() * stacked.element_size()
        self.stats.send_seconds += time.perf_counter() - start

    def after_step(self) -> None:
        now = time.perf_counter()
        for send, m, _ in self._due:
            send.sent.add(m)
            if len(send.sent) == len(send.spans) and not send.compute_end:
                self._sending.pop(send.transfer.seq_id, None)
                with self._lock:
                    send.compute_end = now
                    if not send.outstanding:
                        self._sent_whole(send)
        self._due = []

    def _sent_whole(self, send: _Send) -> None:
        """Every message of `send` completed and the step that sent the last one ended."""
        self.stats.transfers_sent += 1
        self.stats.transfer_seconds += send.last_done - send.first_post
        self.stats.overlapped_seconds += min(send.last_done, send.compute_end) - send.first_post

    def _complete_sends(self) -> None:
        failed: set[int] = set()
        while True:
            send, work, _tensor = self._sent.get()  # the tensor lives until sent
            try:
                work.wait()
            except Exception as e:  # the peer is gone: its replica fails its own requests
                transfer = send.transfer.transfer if send is not None else -1
                if transfer not in failed:
                    failed.add(transfer)
                    log.warning("KV transfer %d: a send failed: %s", transfer, e)
            if send is None:
                continue
            with self._lock:
                send.outstanding -= 1
                send.last_done = time.perf_counter()
                if not send.outstanding and send.compute_end:
                    self._sent_whole(send)


def _await(receive: _Receive, works: list[Pending]) -> None:
    try:
        for work in works:
            work.wait()
    except Exception as e:  # the peer is gone (or the pair broke)
        receive.error = f"{type(e).__name__}: {e}"
    receive.finished = time.perf_counter()
    receive.done.set()
