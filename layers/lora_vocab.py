"""LoRA adapters on the embedding: each row's delta is its id's row of the adapter's A^T
times B^T (PEFT's lora_embedding_A (r, vocab) and lora_embedding_B (hidden, r)), scaled.

Under tensor parallelism the embedding is split by vocabulary rows (layers/embedding.py), so
A^T is too: a rank looks up only the ids in its range, multiplies by the whole B, and adds
its share of the delta before the embedding's all-reduce sums the shares, as it sums the
lookups. The expand multiplies the looked-up rows by an identity A and then by B, which is
the layers' product (layers/lora.py LoraBatch.add), so the same kernel groups the rows by slot."""

from __future__ import annotations

import torch

from meshserve.layers.lora import LoraBatch


class LoraEmbedding:
    """The embedding's adapter slots on a rank: A^T's rows of the rank's vocabulary range
    (slots, local vocab, max_rank) and B (slots, hidden, max_rank), PEFT's scaling folded
    into B."""

    def __init__(self, batch: LoraBatch, num_slots: int, max_rank: int, vocab_start: int, vocab_size: int,
                 local_vocab: int, hidden: int, dtype: torch.dtype, device: torch.device):
        """`vocab_start`, `local_vocab`: this rank's range of the (padded) vocabulary of
        `vocab_size` real rows."""
        self.batch, self.vocab_start, self.local_vocab = batch, vocab_start, local_vocab
        self.rows = max(0, min(local_vocab, vocab_size - vocab_start))
        """The range's real rows (past the vocabulary's end, padding stays zero)."""
        self.a = torch.zeros(num_slots, local_vocab, max_rank, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, hidden, max_rank, dtype=dtype, device=device)
        self.eye = torch.eye(max_rank, dtype=dtype, device=device).expand(num_slots, max_rank, max_rank).contiguous()
        self._ones = torch.ones(num_slots, dtype=dtype, device=device)
        self.loaded = [False] * num_slots

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.eye))

    def load(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None, scaling: float) -> None:
        """Put an adapter's (A (r, vocab), B (hidden, r)), unsharded float32, into `slot`
        (None: the adapter leaves the embedding alone)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.loaded[slot] = pair is not None
        if pair is None:
            return
        a, b = pair
        r = a.shape[0]
        self.a[slot, :self.rows, :r] = a[:, self.vocab_start:self.vocab_start + self.rows].T
        self.b[slot, :, :r] = b * scaling

    def apply(self, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`y`, this rank's lookup of `ids` (zeros for ids out of its range), plus each row's
        share of its adapter's delta."""
        if not self.batch.uses(self.loaded):
            return y
        slots = self.batch.slots
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.local_vocab) & (slots >= 0)
        rows = self.a[slots.clamp(min=0), local * mine] * mine.unsqueeze(-1).to(self.a.dtype)
        return self.batch.add(y, rows, self.eye, self.b, self._ones)
