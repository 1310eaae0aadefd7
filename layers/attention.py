"""Paged attention: the module the model calls, the metadata every paged CPU backend
shares, and the torch reference backend's metadata and math (pure torch: the oracle the
other backends are tested against, meshserve.layers.backend).

The KV cache of one layer is two tensors (k_cache, v_cache) of shape
(num_blocks, block_size, local_num_kv_heads, head_dim). A sequence's tokens live in the
blocks its block table lists; token t of a sequence is at slot
block_table[t // block_size] * block_size + t % block_size.

A step is a flat batch of new tokens from several sequences: sequences with one new
token (decodes), and the tokens of short chunks after a cached prefix, are computed
together in one batched call (gather + SDPA), one row each; sequences with several (prefill
chunks) one by one, each attending to its cached prefix and itself, causally, in blocks of
QUERY_BLOCK rows.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.layers import kv_quant


QUERY_BLOCK = 64
"""Rows of a prefill chunk per attention call. Each block attends only to the keys up to
its own last row, which torch's CPU flash kernel under is_causal does not skip: faster up
to prompts of a thousand tokens or so, the same beyond."""


DECODE_ROWS = 16
"""A chunk of at most this many tokens after a cached prefix (speculative decoding's verified
drafts, a small chunked-prefill tail) attends as that many decode rows, each over the cache
up to its own position (its K/V stored before any attention reads), instead of gathering
its sequence's cache for one masked call: the decode kernels read the cache in place."""


@dataclass
class QueryBlock:
    start: int
    """First row of the block within its chunk."""
    end: int
    kv_len: int
    """Keys it attends to: the cached prefix and the chunk's rows up to `end`."""
    mask: torch.Tensor | None
    """(end - start, kv_len) bool, causal; None for a square block (the chunk's first, no
    prefix), which the kernel masks itself (is_causal), a little faster than with a mask."""


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

    @property
    def fresh(self) -> bool:
        """No cached prefix: the chunk attends only to itself."""
        return self.seq_len == self.query_len


@dataclass
class PagedMetadata:
    """Per-step inputs shared by every layer (flash-attn / vLLM names): what the torch and
    cpu backends' metadata have in common."""

    slot_mapping: torch.Tensor
    """(num_tokens,) cache slot of each new token."""
    query_start_loc: list[int]
    """(num_seqs + 1,) cu_seqlens_q, on the host."""
    decode_rows: torch.Tensor | None = None
    """(num_decodes,) rows of the flat batch that attend as decodes: the single-token
    sequences, and each token of a short chunk after a cached prefix (DECODE_ROWS)."""
    decode_block_tables: torch.Tensor | None = None
    """(num_decodes, max_blocks) block ids, padded with block 0."""
    decode_skip: torch.Tensor | None = None
    """(num_decodes,) int64, or None: the keys of its last 64 positions each decode row does
    not attend to, bit j for position len - 1 - j (a draft tree's rows see their own path,
    engine/speculative/tree.py)."""
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def decode_only(self) -> bool:
        """Every sequence of the step decodes one token (what a compiled decode graph runs)."""
        return not self.prefills and self.decode_rows is not None

    def for_graph(self) -> None:
        """Readies a decode step for the compiled graphs (engine/compiled_decode.py): pads a
        block table one block wide to two (the graphs are traced with a width above 1, and
        width 1 would be a graph of its own; the lengths or the mask hide the padding)."""
        if self.decode_block_tables.shape[1] == 1:
            self.decode_block_tables = torch.cat([self.decode_block_tables, self.decode_block_tables], dim=1)

    def dynamic_tensors(self) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, int]]]:
        """For torch.compile: the tensors whose first size is the batch, and (tensor, dim)
        of the sizes that follow the block-table width."""
        return [self.slot_mapping, self.decode_rows, self.decode_block_tables], [(self.decode_block_tables, 1)]


@dataclass
class AttentionMetadata(PagedMetadata):
    """The torch backend's metadata."""

    decode_mask: torch.Tensor | None = None
    """(num_decodes, 1, 1, max_blocks * block_size) bool: which cached positions exist
    (for the gather + SDPA of the decodes)."""
    workspace: "GatherWorkspace | None" = None
    """The backend's reusable buffers for the decode gather, if it keeps them."""

    def for_graph(self) -> None:
        """Also drops the kept gather buffers: the graph plans its own, and kept ones would
        be traced as inputs and guarded on."""
        self.workspace = None
        if self.decode_block_tables.shape[1] == 1:
            self.decode_mask = torch.cat([self.decode_mask, torch.zeros_like(self.decode_mask)], dim=3)
        super().for_graph()

    def dynamic_tensors(self) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, int]]]:
        batch, width = super().dynamic_tensors()
        return batch + [self.decode_mask], width + [(self.decode_mask, 3)]


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


def build_paged_metadata(kind: type[PagedMetadata], query_lens: list[int], seq_lens: list[int],
                         block_tables: list[list[int]], block_size: int, device: torch.device | str = "cpu",
                         **extra) -> tuple[PagedMetadata, torch.Tensor | None]:
    """Host lists -> the fields of PagedMetadata, as a `kind` (with `extra` fields), and
    the decodes' cached lengths (int64, None without decodes) for the backend's own fields."""
    starts, slots = starts_and_slots(query_lens, seq_lens, block_tables, block_size)
    meta = kind(slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), query_start_loc=starts, **extra)
    lens = None
    as_rows = [q == 1 or (q <= DECODE_ROWS and s > q) for q, s in zip(query_lens, seq_lens)]
    decodes = [(starts[i] + j, seq_lens[i] - q + j + 1, i) for i, q in enumerate(query_lens) if as_rows[i]
               for j in range(q)]
    if decodes:
        width = max(len(block_tables[i]) for _, _, i in decodes)
        tables = [block_tables[i] + [0] * (width - len(block_tables[i])) for _, _, i in decodes]
        meta.decode_rows = torch.tensor([row for row, _, _ in decodes], dtype=torch.long, device=device)
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=device)
        lens = torch.tensor([n for _, n, _ in decodes], dtype=torch.long, device=device)
    for i, q in enumerate(query_lens):
        if as_rows[i]:
            continue
        s = seq_lens[i]
        n_blocks = (s + block_size - 1) // block_size
        meta.prefills.append(PrefillChunk(starts[i], q, s, torch.tensor(block_tables[i][:n_blocks], device=device),
                                          query_blocks(q, s - q, device)))
    return meta, lens


def build_attention_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                             block_size: int, device: torch.device | str = "cpu",
                             workspace: GatherWorkspace | None = None) -> AttentionMetadata:
    """Host lists -> the tensors the torch backend needs, built once per step."""
    meta, lens = build_paged_metadata(AttentionMetadata, query_lens, seq_lens, block_tables, block_size, device,
                                      workspace=workspace)
    if lens is not None:
        width = meta.decode_block_tables.shape[1] * block_size
        meta.decode_mask = (torch.arange(width, device=device)[None, :] < lens[:, None])[:, None, None, :]
    return meta


def set_tree_skips(meta, row_skips: list[int]) -> None:
    """Gives a step's decode rows the keys they skip (`row_skips`: per row of the flat batch,
    bit j for the key at the row's position less j; 0 for a row that sees its whole
    sequence): a draft tree's rows (engine/speculative/tree.py) attend to their own path
    only. Only decode rows can skip keys: a tree fits within DECODE_ROWS. `meta`: any
    backend's metadata with decode_rows (and the torch backend's dense decode_mask)."""
    rows = meta.decode_rows.tolist() if meta.decode_rows is not None else []
    if sum(1 for s in row_skips if s) > sum(1 for r in rows if row_skips[r]):
        raise ValueError("a row that skips keys is not a decode row (a draft tree longer than DECODE_ROWS?)")
    skips = [row_skips[r] for r in rows]
    if not any(skips):
        return
    device = meta.slot_mapping.device
    meta.decode_skip = torch.tensor(skips, dtype=torch.long, device=device)
    mask = getattr(meta, "decode_mask", None)
    if mask is not None:
        lens = mask[:, 0, 0, :].sum(-1).tolist()
        cut = [(i, lens[i] - 1 - j) for i, s in enumerate(skips) for j in range(64) if s >> j & 1]
        mask[[i for i, _ in cut], 0, 0, [p for _, p in cut]] = False


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
    computed by `backend` (meshserve.layers.backend) on the metadata that backend built
    for the step (with context parallelism, a backend that also moves K/V blocks and
    partial outputs over the group)."""

    def __init__(self, local_num_heads: int, local_num_kv_heads: int, head_dim: int, *, backend):
        super().__init__()
        self.local_num_heads, self.local_num_kv_heads, self.head_dim = local_num_heads, local_num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta, rope=None) -> torch.Tensor:
        """`rope`: (cos, sin) to rotate q and k by first (the backend may fuse that with its
        cache writes); None: they are rotated already."""
        # q: (num_tokens, local_num_heads, head_dim); k, v: (num_tokens, local_num_kv_heads, head_dim)
        if rope is not None:
            return self.backend.rotary_attention(rope, q, k, v, kv_cache, meta, self.scale)
        return self.backend.attention(q, k, v, kv_cache, meta, self.scale)


def store_kv(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, quantize=kv_quant.quantize) -> None:
    """Writes the new K/V rows into their cache slots; an int8 cache
    (meshserve.layers.kv_quant) stores `quantize(k)`, `quantize(v)`."""
    k_cache, v_cache = kv_cache
    k_rows, v_rows = (quantize(k), quantize(v)) if k_cache.dtype == torch.int8 else (k, v)
    kv_heads, row = k_rows.shape[1], k_rows.shape[2]
    k_cache.view(-1, kv_heads, row).index_copy_(0, slot_mapping, k_rows)
    v_cache.view(-1, kv_heads, row).index_copy_(0, slot_mapping, v_rows)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The torch reference: stores the new K/V, then attends. q: (num_tokens, heads,
    head_dim); k, v: (num_tokens, kv_heads, head_dim)."""
    store_kv(kv_cache, k, v, meta.slot_mapping)
    k_cache, v_cache = kv_cache
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        out[meta.decode_rows] = _decode(q[meta.decode_rows], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        prefill_chunk(q, k, v, kv_cache, chunk, scale, out)
    return out


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
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


def prefill_chunk(q, k, v, kv_cache: tuple[torch.Tensor, torch.Tensor], chunk: PrefillChunk, scale: float,
                  out: torch.Tensor) -> None:
    """Writes one chunk's attention (the flat batch's rows of `chunk`) into `out`, block
    by block: over the chunk's own new K/V when it has no cached prefix, else over its
    rows of the cache."""
    rows = slice(chunk.start, chunk.start + chunk.query_len)
    if chunk.fresh:
        keys, values = k[rows], v[rows]
    else:
        k_cache, v_cache = kv_cache
        keys = _readable(k_cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.seq_len], q.dtype)
        values = _readable(v_cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.seq_len], q.dtype)
    # NOTE: 4-D inputs: with 3-D ones torch's CPU SDPA takes the math path (far slower, L^2 memory).
    queries, keys, values = q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    target = out[rows]
    for b in chunk.query_blocks:
        o = F.scaled_dot_product_attention(queries[:, :, b.start:b.end], keys[:, :, :b.kv_len],
                                           values[:, :, :b.kv_len], attn_mask=b.mask, is_causal=b.mask is None,
                                           scale=scale, enable_gqa=True)
        target[b.start:b.end] = o[0].transpose(0, 1)


def _readable(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from the cache, dequantized if the cache is int8."""
    return kv_quant.dequantize(cached, dtype) if cached.dtype == torch.int8 else cached
