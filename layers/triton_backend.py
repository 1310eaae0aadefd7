"""The Triton backend: meshserve's own kernels behind the `Backend` interface.

Per step it needs the decode sequences (block tables, context lengths, their rows of the
flat batch) and the prefill chunks (first row, query length, tokens in the cache, block
table), all as one int64 tensor computed by numpy on the host and copied to the device in
one transfer. A step's attention is then at most two launches (decode, prefill) per layer
whatever the mix of sequences, plus the KV-cache store.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from meshserve.layers.attention import DECODE_ROWS
from meshserve.layers.backend import Backend
from meshserve.layers.kernels.fused_moe import fused_moe
from meshserve.layers.kernels.decode_attention import block_n_for, choose_num_splits, paged_decode_attention
from meshserve.layers.kernels.prefill_attention import prefill_attention
from meshserve.layers.kernels.rms_norm import rms_norm
from meshserve.layers.kernels.rotary import rotary_, rotary_store_


@dataclass
class TritonMetadata:
    """Per-step inputs of the Triton kernels (flash-attn / vLLM names)."""

    slot_mapping: torch.Tensor
    """(num_tokens,) cache slot of each new token."""
    query_start_loc: list[int]
    """(num_seqs + 1,) cu_seqlens_q, on the host."""
    decode_rows: torch.Tensor
    """(num_decodes,) rows of the single-token sequences in the flat batch."""
    decode_block_tables: torch.Tensor
    """(num_decodes, max_blocks) block ids, padded with block 0."""
    decode_lens: torch.Tensor
    """(num_decodes,) tokens each decode attends to."""
    decode_max_len: int
    """The longest decode context, on the host (it sizes the flash-decoding split)."""
    prefill_starts: torch.Tensor
    """(num_prefills,) first row of each multi-token chunk in the flat batch."""
    prefill_query_lens: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    """(num_prefills, max_blocks), padded with block 0."""
    max_prefill_query_len: int
    decode_skip: torch.Tensor | None = None
    """(num_decodes,) int64 or None: keys each decode row does not attend to (layers.attention.set_tree_skips)."""

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


@lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: one program at a time
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    return choose_num_splits(num_seqs, num_kv_heads, max_len, _num_sms(device), block_n_for(device))


ALIGN_ELEMENTS = 2
"""int64 elements in 16 bytes, the alignment Triton specializes pointers on."""


def as_table(block_tables: list[list[int]] | np.ndarray) -> np.ndarray:
    """Block tables as one int64 (num_seqs, width) array, rows padded with block 0 (an array
    is taken as it is: the runner's rows of its persistent tables, engine/block_tables.py)."""
    if isinstance(block_tables, np.ndarray):
        return block_tables
    width = max((len(t) for t in block_tables), default=0)
    table = np.zeros((len(block_tables), width), dtype=np.int64)
    for row, t in zip(table, block_tables):
        row[:len(t)] = t
    return table


def build_triton_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]] | np.ndarray,
                          block_size: int, device: torch.device | str) -> TritonMetadata:
    """The step's metadata, computed by numpy over per-sequence arrays (no Python loop over
    the tokens or the blocks) and copied to the device in one transfer. `block_tables`: a
    list per sequence, or the (num_seqs, width) rows of the runner's persistent tables
    (entries past a sequence's blocks are ignored)."""
    device = torch.device(device)
    table = as_table(block_tables)
    q_lens, s_lens = np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
    starts = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    token_seq = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = (s_lens - q_lens)[token_seq] + np.arange(starts[-1]) - starts[token_seq]
    slots = table[token_seq, positions // block_size] * block_size + positions % block_size
    # As the torch backend: each token of a decode, or of a short chunk after a cached prefix
    # (DECODE_ROWS), is a decode row attending to the cache up to its own position.
    as_rows = (q_lens == 1) | ((q_lens <= DECODE_ROWS) & (s_lens > q_lens))
    decode_rows = np.flatnonzero(as_rows[token_seq])
    decode_seqs = token_seq[decode_rows]
    decode_lens = positions[decode_rows] + 1
    prefills = np.flatnonzero(~as_rows)

    def padded(seqs: np.ndarray) -> np.ndarray:
        used = -(-s_lens[seqs] // block_size)
        width = int(used.max()) if len(seqs) else 0
        rows = table[seqs, :width]
        return np.where(np.arange(width)[None, :] < used[:, None], rows, 0)

    d_tab, p_tab = padded(decode_seqs), padded(prefills)
    parts = [slots, decode_rows, d_tab.ravel(), decode_lens, starts[prefills], q_lens[prefills], s_lens[prefills],
             p_tab.ravel()]
    # Every part starts on 16 bytes: Triton specializes a kernel on its pointers' alignment, and
    # parts at odd offsets compiled extra variants of the attention kernels mid-serving (a
    # noticeable stall each, paid by whichever request first met that alignment).
    sizes = [len(p) for p in parts]
    aligned = [-(-n // ALIGN_ELEMENTS) * ALIGN_ELEMENTS for n in sizes]
    packed = np.zeros(sum(aligned), dtype=np.int64)
    at = 0
    for part, n in zip(parts, aligned):
        packed[at:at + len(part)] = part
        at += n
    flat = torch.from_numpy(packed)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    (slot_mapping, d_rows, d_flat, d_lens, p_starts, p_qlens, p_slens, p_flat) = (
        part[:n] for part, n in zip(flat.split(aligned), sizes))
    return TritonMetadata(slot_mapping, starts.tolist(),
                          d_rows, d_flat.view(d_tab.shape), d_lens, int(decode_lens.max()) if len(decode_lens) else 0,
                          p_starts, p_qlens, p_slens, p_flat.view(p_tab.shape),
                          int(q_lens[prefills].max()) if len(prefills) else 0)


class TritonBackend(Backend):
    """Attention, RMSNorm (+ residual), rotary and the experts of a MoE layer as Triton
    kernels (CUDA; on CPU only under TRITON_INTERPRET=1)."""

    name = "triton"

    def build_metadata(self, query_lens, seq_lens, block_tables, block_size, device="cpu"):
        return build_triton_metadata(query_lens, seq_lens, block_tables, block_size, device)

    def attention(self, q, k, v, kv_cache, meta: TritonMetadata, scale):
        k_cache, v_cache = kv_cache
        kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        return self._attend(q, kv_cache, meta, scale)

    def rotary_attention(self, rope, q, k, v, kv_cache, meta: TritonMetadata, scale):
        """Rotary and the cache writes in one kernel (rotary_store_), then attention."""
        rotary_store_(q, k, v, *rope, *kv_cache, meta.slot_mapping)
        return self._attend(q, kv_cache, meta, scale)

    def _attend(self, q, kv_cache, meta: TritonMetadata, scale):
        """Attention over the cache, which already holds the step's keys and values."""
        k_cache, v_cache = kv_cache
        kv_heads = k_cache.shape[2]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if len(meta.decode_rows):
            paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, scale,
                                   max_len=meta.decode_max_len, rows=meta.decode_rows, out=out,
                                   num_splits=_splits(len(meta.decode_rows), kv_heads, meta.decode_max_len, q.device),
                                   skip=meta.decode_skip)
        if len(meta.prefill_starts):
            prefill_attention(q, k_cache, v_cache, out, meta.prefill_starts, meta.prefill_query_lens,
                              meta.prefill_seq_lens, scale, max_query_len=meta.max_prefill_query_len,
                              block_tables=meta.prefill_block_tables)
        return out

    def cp_decode_lse(self, q, k_cache, v_cache, meta, scale):
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        splits = _splits(q.shape[0], k_cache.shape[2], meta.decode_max_len, q.device)
        return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, scale,
                                      max_len=meta.decode_max_len, out=out, num_splits=splits, return_lse=True)

    def attention_lse(self, q, k, v, scale, q_pos=None, k_pos=None):
        n = q.shape[0]
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        one_seq = torch.tensor([0, n, k.shape[0]], dtype=torch.long, device=q.device)
        lse = prefill_attention(q, k.contiguous(), v.contiguous(), out, one_seq[:1], one_seq[1:2], one_seq[2:], scale,
                                max_query_len=n, q_pos=q_pos, k_pos=k_pos, causal=False, return_lse=True)
        return out, lse

    rms_norm = staticmethod(rms_norm)
    fused_moe = staticmethod(fused_moe)

    @staticmethod
    def rotary(rope, q, k):
        return rotary_(q, k, *rope)
