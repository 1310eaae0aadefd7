"""Paged attention when a sequence's tokens are split over a context-parallel group.

Each CP rank stores only its share of every sequence (meshserve.parallel.context says
which), densely in position order under the shared block table. In a step:
- a long chunk (prefill) is split: each rank computes its own tokens, and attention runs
  as a ring over the ranks' shares (pass-KV);
- a short chunk (a decode token) is replicated: every rank computes it, attends over its
  own share, and the partial outputs are merged exactly through their LSEs.
Only the owner of a token writes its K/V. The attention with LSE itself is the kernel
backend's (meshserve.layers.backend: its `ContextParallelBackend` wraps a rank's kernel
backend with this module's metadata and attention): torch's CPU flash attention
(`decode_lse` below and ring_attention.flash_part, the torch reference), or Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshserve.comm.groups import AxisGroup
from meshserve.parallel.ring_attention import attend, merge_over_cp, ring_attention

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class CPChunk:
    """A multi-token chunk of one sequence, as this rank sees it."""

    start: int
    """First row of the chunk's queries in this rank's flat batch."""
    q_positions: list[int]
    split: bool
    """True: the queries are this rank's share (ring); False: all of the chunk (merge)."""
    block_table: torch.Tensor
    local_positions: list[int]
    """Positions of the tokens this rank holds, after this step's, ascending."""
    peer_lens: list[int]
    """Tokens every rank of the group holds after this step."""


@dataclass
class ContextParallelMetadata:
    store_rows: torch.Tensor
    """Rows of this rank's batch whose K/V this rank stores."""
    slot_mapping: torch.Tensor
    """Their cache slots."""
    decode_rows: torch.Tensor | None = None
    """Rows of single-token (replicated) sequences."""
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    """(num_decodes, 1, 1, width) additive float mask over this rank's share."""
    decode_empty: torch.Tensor | None = None
    """(num_decodes,) this rank holds no token of the sequence."""
    decode_lens: torch.Tensor | None = None
    """(num_decodes,) tokens of each sequence this rank holds."""
    decode_max_len: int = 0
    """Their maximum, on the host."""
    chunks: list[CPChunk] = field(default_factory=list)


@dataclass
class CPSeqStep:
    """Host-side description of one sequence in a step (built by the model runner)."""

    start: int
    q_positions: list[int]
    split: bool
    block_ids: list[int]
    local_positions: list[int]
    peer_lens: list[int]
    stored_rows: list[int]
    stored_local: list[int]
    """Local indices (k-th token held by this rank) of the rows this rank stores."""


def build_cp_metadata(seqs: list[CPSeqStep], rank: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> ContextParallelMetadata:
    rows, slots = [], []
    for s in seqs:
        rows += s.stored_rows
        slots += [s.block_ids[i // block_size] * block_size + i % block_size for i in s.stored_local]
    meta = ContextParallelMetadata(torch.tensor(rows, dtype=torch.long, device=device),
                                   torch.tensor(slots, dtype=torch.long, device=device))
    decodes = [s for s in seqs if len(s.q_positions) == 1]
    if decodes:
        lens = [s.peer_lens[rank] for s in decodes]
        width = max(1, max(-(-n // block_size) for n in lens))
        tables = [s.block_ids[:width] + [0] * (width - len(s.block_ids[:width])) for s in decodes]
        held = torch.tensor(lens, device=device)
        visible = torch.arange(width * block_size, device=device)[None, :] < held[:, None]
        meta.decode_rows = torch.tensor([s.start for s in decodes], dtype=torch.long, device=device)
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=device)
        meta.decode_mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(
            ~visible, float("-inf"))[:, None, None, :]
        meta.decode_empty = held == 0
        meta.decode_lens, meta.decode_max_len = held, max(lens)
    for s in seqs:
        if len(s.q_positions) > 1:
            n_blocks = -(-s.peer_lens[rank] // block_size)
            meta.chunks.append(CPChunk(s.start, s.q_positions, s.split,
                                       torch.tensor(s.block_ids[:n_blocks], dtype=torch.long, device=device),
                                       s.local_positions, s.peer_lens))
    return meta


def cp_attention(q, k, v, kv_cache, meta: ContextParallelMetadata, cp: AxisGroup, scale: float,
                 backend) -> torch.Tensor:
    """q: (num_tokens, local_num_heads, head_dim); k, v: (num_tokens, local_num_kv_heads, head_dim).
    Exchanges K/V blocks (ring) and partial outputs (merge) over `cp`. `backend` computes
    the attention with LSE of each part."""
    k_cache, v_cache = kv_cache
    kv_heads, head_dim = k.shape[1], k.shape[2]
    if len(meta.store_rows):
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k[meta.store_rows])
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v[meta.store_rows])
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        o, lse = backend.cp_decode_lse(q[meta.decode_rows], k_cache, v_cache, meta, scale)
        out[meta.decode_rows] = merge_over_cp(o, lse, cp).to(q.dtype)
    for chunk in meta.chunks:
        rows = slice(chunk.start, chunk.start + len(chunk.q_positions))
        n = chunk.peer_lens[cp.rank]
        keys = k_cache.index_select(0, chunk.block_table).flatten(0, 1)[:n]
        values = v_cache.index_select(0, chunk.block_table).flatten(0, 1)[:n]
        if chunk.split:
            o, _ = ring_attention(q[rows], chunk.q_positions, keys, values, chunk.local_positions, chunk.peer_lens,
                                  cp, scale, backend.attention_lse)
        else:
            o, lse = attend(q[rows], chunk.q_positions, keys, values, chunk.local_positions, scale,
                            backend.attention_lse)
            o = merge_over_cp(o, lse, cp)
        out[rows] = o.to(q.dtype)
    return out


def decode_lse(q, k_cache, v_cache, meta: ContextParallelMetadata, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference for the decode part: each replicated query over this rank's
    share of its sequence. Returns out (num_decodes, heads, head_dim) float32 and lse
    (num_decodes, heads), -inf where this rank holds no token."""
    n, width = meta.decode_block_tables.shape
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    blocks = meta.decode_block_tables.flatten()
    keys = k_cache.index_select(0, blocks).view(n, -1, kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, blocks).view(n, -1, kv_heads, head_dim).transpose(1, 2)
    grouped = q.view(n, kv_heads, -1, head_dim)  # the query heads of a KV head as its "positions"
    o, lse = _flash(grouped, keys, values, 0.0, False, attn_mask=meta.decode_mask, scale=scale)
    o, lse = o.reshape(n, -1, head_dim).float(), lse.reshape(n, -1)
    lse = lse.masked_fill(meta.decode_empty[:, None], float("-inf"))  # no token here: nothing seen
    return o, lse
