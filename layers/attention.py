"""Paged attention: the module the model calls, and the torch reference backend's metadata
and math (CPU, and the oracle for the other backends, meshserve.layers.backend).

The KV cache of one layer is two tensors (k_cache, v_cache) of shape
(num_blocks, block_size, local_num_kv_heads, head_dim). A sequence's tokens live in the
blocks its block table lists; token t of a sequence is at slot
block_table[t // block_size] * block_size + t % block_size.

A step is a flat batch of new tokens from several sequences: sequences with one new
token (decodes) are computed together in one batched call (gather + SDPA, or the cpu
backend's C++ kernel reading the cache in place); sequences with several
(prefill chunks) one by one, each attending to its cached prefix and itself, causally,
in blocks of QUERY_BLOCK rows, except that the cpu backend computes every chunk with no
cached prefix in one call of its C++ prefill kernel.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.comm.groups import AxisGroup
from meshserve.layers import kv_quant
from meshserve.layers.context_attention import ContextParallelMetadata, cp_attention
from meshserve.layers.kernels import cpu_attention


QUERY_BLOCK = 64
"""Rows of a prefill chunk per attention call. Each block attends only to the keys up to
its own last row, which torch's CPU flash kernel under is_causal does not skip (measured
with SmolLM2's 9 heads, 3 KV heads, head_dim 64 on 2 cores, bf16: 512 tokens 2.66 vs
3.52 ms, 1,024 9.6 vs 11.2 ms, 2,048 the same)."""


@dataclass
class QueryBlock:
    start: int
    """First row of the block within its chunk."""
    end: int
    kv_len: int
    """Keys it attends to: the cached prefix and the chunk's rows up to `end`."""
    mask: torch.Tensor | None
    """(end - start, kv_len) bool, causal; None for a square block (the chunk's first, no
    prefix), which the kernel masks itself (is_causal), a little faster (86 vs 96 us at 64 rows)."""


@dataclass
class PrefillChunk:
    start: int
    """First row of this sequence's tokens in the flat batch."""
    query_len: int
    seq_len: int
    """Tokens in the cache after this step: cached prefix + query_len."""
    block_table: torch.Tensor
    """(num_blocks_of_seq,) block ids."""
    query_blocks: list[QueryBlock] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every layer (flash-attn / vLLM names)."""

    slot_mapping: torch.Tensor
    """(num_tokens,) cache slot of each new token."""
    query_start_loc: list[int]
    """(num_seqs + 1,) cu_seqlens_q, on the host."""
    seq_lens: list[int]
    """(num_seqs,) tokens in the cache after this step, on the host."""
    decode_rows: torch.Tensor | None = None
    """(num_decodes,) rows of the single-token sequences in the flat batch."""
    decode_block_tables: torch.Tensor | None = None
    """(num_decodes, max_blocks) block ids, padded with block 0."""
    decode_mask: torch.Tensor | None = None
    """(num_decodes, 1, 1, max_blocks * block_size) bool: which cached positions exist
    (for the gather + SDPA path)."""
    decode_lens: torch.Tensor | None = None
    """(num_decodes,) int64 cached tokens of each: set instead of decode_mask for the cpu
    backend's C++ kernel, which reads the cache in place."""
    fresh_chunks: torch.Tensor | None = None
    """(n, 2) int64 first row and length of each prefill chunk with no cached prefix: the
    cpu backend's C++ prefill kernel computes them all in one call."""
    prefills: list[PrefillChunk] = field(default_factory=list)
    workspace: "GatherWorkspace | None" = None
    """The backend's reusable buffers for the decode gather, if it keeps them."""

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


class GatherWorkspace:
    """Buffers the decode gather of K and V writes into, kept across layers and steps: a
    fresh multi-MiB tensor per layer costs page faults (measured: index_select into a kept
    buffer takes half the time of one into a new tensor). Layers run one at a time, so one
    pair serves them all; gathers above MAX_KEPT_BYTES get fresh tensors (not kept)."""

    MAX_KEPT_BYTES = 64 << 20

    def __init__(self):
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def buffers(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        numel = math.prod(shape)
        if numel * like.element_size() > self.MAX_KEPT_BYTES:
            return None
        if self._k is None or self._k.numel() < numel or self._k.dtype != like.dtype or self._k.device != like.device:
            self._k = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._v = torch.empty_like(self._k)
        return self._k[:numel].view(shape), self._v[:numel].view(shape)


def starts_and_slots(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                     block_size: int) -> tuple[list[int], list[int]]:
    """Each sequence's first row in the flat batch (plus the total), and the cache slot of
    every new token: what every backend's metadata starts from."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots: list[int] = []
    for q, s, table in zip(query_lens, seq_lens, block_tables):
        for pos in range(s - q, s):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return starts, slots


def build_attention_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                             block_size: int, device: torch.device | str = "cpu",
                             workspace: GatherWorkspace | None = None,
                             cpu_kernels: bool = False) -> AttentionMetadata:
    """Host lists -> the tensors the torch backend needs, built once per step;
    `cpu_kernels`: for the cpu backend's C++ kernels (decode lengths instead of a mask, and
    the spans of the chunks with no cached prefix)."""
    starts, slots = starts_and_slots(query_lens, seq_lens, block_tables, block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=starts,
        seq_lens=list(seq_lens),
        workspace=workspace,
    )
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    if decodes:
        width = max(len(block_tables[i]) for i in decodes)
        tables = [block_tables[i] + [0] * (width - len(block_tables[i])) for i in decodes]
        meta.decode_rows = torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=device)
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=device)
        lens = torch.tensor([seq_lens[i] for i in decodes], dtype=torch.long, device=device)
        if cpu_kernels:
            meta.decode_lens = lens
        else:
            meta.decode_mask = (torch.arange(width * block_size, device=device)[None, :]
                                < lens[:, None])[:, None, None, :]
    for i, q in enumerate(query_lens):
        if q == 1:
            continue
        s = seq_lens[i]
        n_blocks = (s + block_size - 1) // block_size
        meta.prefills.append(PrefillChunk(starts[i], q, s, torch.tensor(block_tables[i][:n_blocks], device=device),
                                          query_blocks(q, s - q, device)))
    fresh = [[starts[i], q] for i, q in enumerate(query_lens) if q > 1 and seq_lens[i] == q]
    if cpu_kernels and fresh:
        meta.fresh_chunks = torch.tensor(fresh, dtype=torch.long, device=device)
    return meta


def query_blocks(query_len: int, prefix: int, device) -> list[QueryBlock]:
    """A chunk's rows in QUERY_BLOCK-row blocks, each with its causal mask (built once per
    step, used by every layer)."""
    blocks = []
    for start in range(0, query_len, QUERY_BLOCK):
        end = min(query_len, start + QUERY_BLOCK)
        kv_len = prefix + end
        mask = None
        if start + prefix:
            mask = torch.arange(kv_len, device=device)[None, :] <= torch.arange(start + prefix, end + prefix,
                                                                                 device=device)[:, None]
        blocks.append(QueryBlock(start, end, kv_len, mask))
    return blocks


class PagedAttention(nn.Module):
    """softmax(q k^T * scale) v over each sequence's cached keys and values, with GQA,
    computed by `backend` (meshserve.layers.backend). With a context-parallel group of
    several ranks, the step's metadata is a ContextParallelMetadata and the ranks exchange
    K/V blocks and partial outputs over `cp`."""

    def __init__(self, local_num_heads: int, local_num_kv_heads: int, head_dim: int, cp: AxisGroup | None = None,
                 *, backend):
        super().__init__()
        self.local_num_heads, self.local_num_kv_heads, self.head_dim = local_num_heads, local_num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.cp = cp
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        # q: (num_tokens, local_num_heads, head_dim); k, v: (num_tokens, local_num_kv_heads, head_dim)
        if isinstance(meta, ContextParallelMetadata):
            return cp_attention(q, k, v, kv_cache, meta, self.cp, self.scale, self.backend)
        return self.backend.attention(q, k, v, kv_cache, meta, self.scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    meta: AttentionMetadata, scale: float, quantize=kv_quant.quantize) -> torch.Tensor:
    """The torch reference: stores the new K/V, then attends. q: (num_tokens, heads,
    head_dim); k, v: (num_tokens, kv_heads, head_dim). An int8 cache (meshserve.layers.kv_quant)
    stores `quantize(k)`, `quantize(v)`."""
    k_cache, v_cache = kv_cache
    k_rows, v_rows = (quantize(k), quantize(v)) if k_cache.dtype == torch.int8 else (k, v)
    kv_heads, row = k_rows.shape[1], k_rows.shape[2]
    k_cache.view(-1, kv_heads, row).index_copy_(0, meta.slot_mapping, k_rows)
    v_cache.view(-1, kv_heads, row).index_copy_(0, meta.slot_mapping, v_rows)
    fresh = meta.fresh_chunks is not None and cpu_attention.prefill_fits(q.shape[-1])
    out = cpu_attention.prefill_attention(q, k, v, meta.fresh_chunks, scale) if fresh else torch.empty_like(q)
    if meta.decode_rows is not None:
        out[meta.decode_rows] = _decode(q[meta.decode_rows], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        if fresh and chunk.seq_len == chunk.query_len:
            continue
        rows = slice(chunk.start, chunk.start + chunk.query_len)
        _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale, out=out[rows])
    return out


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if meta.decode_lens is not None:
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens,
                                                    scale)
    n, width = meta.decode_block_tables.shape
    heads, kv_heads, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
    blocks = meta.decode_block_tables.flatten()
    # (num_decodes * max_blocks, block_size, kv_heads, head_dim) -> (num_decodes, kv_heads, max_len, head_dim)
    kept = meta.workspace.buffers((len(blocks), *k_cache.shape[1:]), k_cache) if meta.workspace else None
    if kept is None:
        keys, values = k_cache.index_select(0, blocks), v_cache.index_select(0, blocks)
    else:
        keys = torch.index_select(k_cache, 0, blocks, out=kept[0])
        values = torch.index_select(v_cache, 0, blocks, out=kept[1])
    keys, values = _readable(keys, q.dtype), _readable(values, q.dtype)
    keys = keys.view(n, -1, kv_heads, head_dim).transpose(1, 2)
    values = values.view(n, -1, kv_heads, head_dim).transpose(1, 2)
    # NOTE: GQA as a short query: the query heads sharing a KV head become that head's
    # "query positions" (no causal mask), so no KV head is repeated.
    grouped = q.view(n, kv_heads, -1, head_dim)  # (num_decodes, kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(n, heads, head_dim)


def _prefill(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale: float, out: torch.Tensor) -> None:
    """Writes the chunk's attention into `out` (query_len, heads, head_dim), block by block."""
    if chunk.seq_len == chunk.query_len:  # no cached prefix: attend within the chunk, the new K/V at hand
        keys, values = k, v
    else:
        keys = _readable(k_cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.seq_len], q.dtype)
        values = _readable(v_cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.seq_len], q.dtype)
    # NOTE: 4-D inputs: with 3-D ones torch's CPU SDPA takes the math path (8x slower, L^2 memory).
    q, keys, values = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    for b in chunk.query_blocks:
        o = F.scaled_dot_product_attention(q[:, :, b.start:b.end], keys[:, :, :b.kv_len], values[:, :, :b.kv_len],
                                           attn_mask=b.mask, is_causal=b.mask is None, scale=scale, enable_gqa=True)
        out[b.start:b.end] = o[0].transpose(0, 1)


def _readable(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from the cache, dequantized if the cache is int8."""
    return kv_quant.dequantize(cached, dtype) if cached.dtype == torch.int8 else cached
