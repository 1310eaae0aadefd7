"""Decode steps replayed from captured graphs (CUDA graphs, as every GPU engine does): a
step of n decoding sequences launches hundreds of small kernels, and on a GPU their launch
overhead, not the bandwidth, bounds the step; one graph replay launches them all at once.

Per batch-size bucket (1, 2, 4, 8, then steps of 8 up to the largest batch), one graph of
the model's forward is captured over static tensors: the token ids, positions and the
backend's metadata of `bucket` sequences whose block tables are as wide as
model.max_model_len allows. A step of n sequences takes the smallest bucket that holds
them: its real rows are copied into the static tensors, the rows past n are padding (one
token each, written to a scratch block no sequence owns, attending to that token alone),
the graph replays, and the first n rows of its output are the step's. Host values of the
metadata that size kernel grids (the Triton backend's longest context) stay those of the
capture, made for the longest context, so every replay's grid covers its sequences.

What captures and replays is behind `Capture`: `CudaCapture` (torch.cuda.CUDAGraph, one
memory pool for all buckets) on a GPU, and `EagerStandIn` on a CPU, which runs the same
function over the same static tensors at replay: every step of the logic above (buckets,
padding, the scratch block, static metadata, the output rows) is tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every 8, up to the first that holds `max_batch` sequences."""
    out = []
    for b in [1, 2, 4] + list(range(8, max(max_batch, 1) + 8, 8)):
        out.append(b)
        if b >= max_batch:
            break
    return out


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds n sequences, or None (the step runs eagerly)."""
    return next((b for b in buckets if b >= n), None)


class Capture(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record `fn` (which reads only static tensors) and return its static output."""

    def replay(self) -> None:
        """Run what was recorded again, refreshing the static output in place."""


class CudaCapture:
    """torch.cuda.CUDAGraph over the memory pool of `owner` (its `pool`), shared by every
    bucket's graph of one DecodeGraphs (captured largest first)."""

    def __init__(self, owner):
        self.owner = owner
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn):
        fn()  # warm-up outside the graph: lazy initialisation, autotuning, allocator
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.owner.pool):
            out = fn()
        self.owner.pool = self.graph.pool()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerStandIn:
    """The CPU stand-in: replay runs the recorded function over the static tensors and copies
    its result into the static output, as a replayed graph rewrites it."""

    def __init__(self):
        self.fn = None
        self.out = None

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


@dataclasses.dataclass
class _Bucket:
    size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: object
    capture: Capture
    out: torch.Tensor | None = None
    """The static (size, hidden) output: the final-normed hidden states."""


class DecodeGraphs:
    """The model's decode forward, captured per batch bucket. One pipeline stage of one
    tensor-parallel group: the collectives inside (NCCL all-reduces) are captured with it."""

    def __init__(self, model, kv_caches, block_size: int, max_model_len: int, scratch_block: int, max_batch: int,
                 device: torch.device, make_capture: Callable[[], Capture] | None = None, forward=None):
        """`scratch_block`: a KV block no sequence owns (the padding rows write there).
        `forward`: what is captured (default the model's forward; engine/decode_path.py
        passes its eager forward)."""
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.forward = forward or model
        self.width = -(-max_model_len // block_size)
        self.max_model_len, self.scratch_block, self.device = max_model_len, scratch_block, device
        self.buckets = batch_buckets(max_batch)
        self.pool = None
        """The CUDA graphs' memory pool, once the first (largest) bucket is captured."""
        self.make_capture = make_capture or ((lambda: CudaCapture(self)) if device.type == "cuda" else EagerStandIn)
        self.graphs: dict[int, _Bucket] = {}
        self.replays = 0
        self.capture_seconds = 0.0

    def _metadata(self, seq_lens: list[int], block_tables: list[list[int]] | np.ndarray):
        """`block_tables`: lists, or the rows of the runner's persistent tables (the Triton
        backend's, which reads each row only up to its sequence's blocks)."""
        if isinstance(block_tables, np.ndarray):
            tables = np.full((len(block_tables), self.width), self.scratch_block, dtype=np.int64)
            width = min(self.width, block_tables.shape[1])
            tables[:, :width] = block_tables[:, :width]
        else:
            tables = [t[: self.width] + [self.scratch_block] * (self.width - len(t[: self.width])) for t in block_tables]
        return self.model.backend.build_metadata([1] * len(seq_lens), seq_lens, tables, self.block_size, self.device)

    def _padded(self, size: int, seq_lens: list[int], block_tables: list[list[int]] | np.ndarray):
        pad = size - len(seq_lens)
        if isinstance(block_tables, np.ndarray):
            return seq_lens + [1] * pad, np.concatenate(
                [block_tables, np.full((pad, block_tables.shape[1]), self.scratch_block, dtype=np.int64)])
        return seq_lens + [1] * pad, block_tables + [[self.scratch_block]] * pad

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, the largest first (its memory serves the smaller ones)."""
        start = time.perf_counter()
        for size in sorted(self.buckets, reverse=True):
            # the widest tables and longest contexts a replay can have: grids sized for them
            seq_lens = [self.max_model_len] * size
            tables = [[self.scratch_block] * self.width] * size
            meta = self._metadata(seq_lens, tables)
            ids = torch.zeros(size, dtype=torch.long, device=self.device)
            positions = torch.zeros(size, dtype=torch.long, device=self.device)
            bucket = _Bucket(size, ids, positions, meta, self.make_capture())
            bucket.out = bucket.capture.capture(lambda b=bucket: self._forward(b))
            self.graphs[size] = bucket
        for k, v in self.kv_caches:  # the capture wrote into the scratch block only
            k[self.scratch_block].zero_()
            v[self.scratch_block].zero_()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured decode graphs for batch sizes %s in %.1f s", self.buckets, self.capture_seconds)

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        hidden, _ = self.forward(bucket.input_ids, bucket.positions, self.kv_caches, bucket.meta)
        return hidden

    def fits(self, query_lens: list[int]) -> bool:
        """Whether a step runs from a graph: every sequence decodes one token, and a bucket
        holds them."""
        return bool(query_lens) and all(q == 1 for q in query_lens) and bucket_for(len(query_lens), self.buckets) \
            is not None and bool(self.graphs)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """The step's (n, hidden) final-normed hidden states, from its bucket's graph.
        `input_ids`: (n,) on the device (an overlapped step's come partly from the step
        before it, never from the host)."""
        n = len(input_ids)
        bucket = self.graphs[bucket_for(n, self.buckets)]
        seq_lens, block_tables = self._padded(bucket.size, seq_lens, block_tables)
        pad = bucket.size - n
        scratch_slot = self.scratch_block * self.block_size
        bucket.input_ids[:n].copy_(input_ids)
        if pad:
            bucket.input_ids[n:].zero_()
        bucket.positions.copy_(torch.tensor(positions + [0] * pad, dtype=torch.long))
        fresh = self._metadata(seq_lens, block_tables)
        copy_metadata(bucket.meta, fresh)
        if pad:  # every padding row writes the scratch block's first slot
            bucket.meta.slot_mapping[n:].fill_(scratch_slot)
        bucket.capture.replay()
        self.replays += 1
        return bucket.out[:n]


def copy_metadata(static, fresh) -> None:
    """Copy a step's metadata into the captured one, tensor by tensor (same bucket: the same
    rows). A tensor narrower in its last dimension (block tables and masks that a backend
    cut to the step's longest context) fills the leading columns, zeros the rest: block 0,
    masked out or past every length. Host values (lists, ints) keep the capture's: they
    size grids and loops, which the captured kernels fixed."""
    for f in dataclasses.fields(static):
        dst, src = getattr(static, f.name), getattr(fresh, f.name)
        if not isinstance(dst, torch.Tensor):
            continue
        if dst.shape == src.shape:
            dst.copy_(src)
        elif dst.shape[:-1] == src.shape[:-1] and src.shape[-1] <= dst.shape[-1]:
            dst.zero_()
            dst[..., :src.shape[-1]].copy_(src)
        else:
            raise ValueError(f"metadata {f.name}: the step's shape {tuple(src.shape)} does not fit the captured "
                             f"{tuple(dst.shape)}")
