"""Vocab-parallel embedding and LM head: the vocabulary is split into tp equal ranges
(padded to a multiple of tp), rank i holding rows [i * V/tp, (i+1) * V/tp)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.comm.collectives import gather_from_tp, reduce_from_tp
from meshserve.comm.groups import AxisGroup
from meshserve.layers.matmul import DenseCpuMatmul
from meshserve.layers.matmul_plan import MatmulPlan
from meshserve.layers.weights import CheckpointTensor
from meshserve.parallel.sequence import SequenceParallel


class VocabParallelEmbedding(nn.Module):
    """Rank i looks up the ids in its range and writes zeros for the others; the sum
    over ranks is the full embedding.

    All-reduces the output over `tp`; where sequence parallelism splits the step (`sp`),
    reduce-scatters it instead (each rank gets its rows)."""

    sp: SequenceParallel | None = None

    def __init__(self, vocab_size: int, hidden_size: int, tp: AxisGroup, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab_size = math.ceil(vocab_size / tp.size)
        self.vocab_start = tp.rank * self.local_vocab_size
        self.vocab_end = self.vocab_start + self.local_vocab_size
        self.weight = nn.Parameter(torch.empty(self.local_vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.lora = None
        """Its LoRA adapters' slots (layers/lora_vocab.py; the head's: layers/lora.py), where
        the server serves adapters that may target it."""

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        rows = max(0, min(self.local_vocab_size, self.vocab_size - self.vocab_start))
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint vocab has {loaded.shape[0]} rows, the model {self.vocab_size}")
        with torch.no_grad():
            param.zero_()  # padding rows beyond the real vocabulary stay zero
            if rows:
                param[:rows].copy_(loaded.narrow(0, self.vocab_start, rows).load())

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids`; where a tied head's copy replaced the weight (the weight's
        `table`, layers/matmul.py DenseCpuMatmul), from there."""
        table = getattr(self.weight, "table", None)
        return F.embedding(ids, self.weight) if table is None else table.rows(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # (num_tokens,) -> (num_tokens, hidden_size)
        if self.tp.size == 1:
            out = self.lookup(input_ids)
            return out if self.lora is None else self.lora.apply(out, input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * mine
        out = self.lookup(local_ids)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        if self.lora is not None:
            out = self.lora.apply(out, input_ids)
        return reduce_from_tp(out, self.tp) if self.sp is None else self.sp.reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T with W split by vocabulary rows; rank i computes its vocabulary
    slice, and the slices are gathered to TP rank 0, the sampling rank.

    Gathers the logits over `tp` to tp rank 0; other ranks get None."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: AxisGroup, dtype: torch.dtype = torch.float32,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden_size, tp, dtype)
        if tied_to is not None:
            self.weight = tied_to.weight
        self.packed = None
        """What multiplies the weight once prepared (meshserve.layers.matmul_plan), or None."""

    def pack_weight(self, plan: MatmulPlan) -> None:
        """After loading: multiply by what the plan's head kernel prepares (a quantized or
        packed copy). The weight stays (it may be the embedding's too), except where the copy
        is meshserve's panels: they replace it, and become the weight's `table`, where a tied
        embedding looks its rows up."""
        if self.packed is None:
            self.packed = plan.head.prepare(self.weight)
            if isinstance(self.packed, DenseCpuMatmul):
                self.weight.table = self.packed
                self.weight.data = self.weight.data.new_empty(0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # (num_samples, hidden_size) -> (num_samples, vocab_size) on tp rank 0
        local = F.linear(hidden, self.weight) if self.packed is None else self.packed(hidden)
        if self.lora is not None:
            local = self.lora.apply(local, hidden)
        logits = gather_from_tp(local, self.tp, dst=0)
        return None if logits is None else logits[:, : self.vocab_size]
