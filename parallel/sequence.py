"""Sequence parallelism inside a tensor-parallel group (Megatron-LM's, for inference).

Between a row-parallel linear and the next column-parallel one, every TP rank holds the
step's whole (num_tokens, hidden) activations (the residual stream and the norms' outputs),
equal on every rank. On a step that splits, a rank keeps only its own rows of them: the
row-parallel linear (and the embedding, and a MoE block) reduce-scatters its partial sums in
place of the all-reduce (each rank sums only its rows), the norms and residual adds run on
those rows, and the column-parallel linear all-gathers them before its product. The same
bytes cross the group (an all-reduce is a reduce-scatter then an all-gather); what shrinks
is what is held between the linears, and the norm work, by the TP size.

Rows: with m = ceil(num_tokens / tp), member i holds rows [i*m, i*m + counts[i]), the last
member what is left, so the gathered rows are the step's rows in order.

The line: a step splits when it has at least `min_tokens` tokens (parallel.
sequence_parallel_min_tokens) and at least tp**2 (so that every member has a row). Decode
steps, one token per sequence, stay below it and keep the all-reduce: splitting a few rows
saves nothing and costs a collective more per linear pair.
"""

from __future__ import annotations

import torch

from meshserve.comm.collectives import all_gather_rows, reduce_from_tp, reduce_scatter_rows
from meshserve.comm.groups import AxisGroup


class SequenceParallel:
    """The split of the current step over `tp`, shared by the layers at the residual
    stream's edges (layers/linear.py, layers/embedding.py, layers/moe.py); the model sets it
    at the start of each forward (`plan`)."""

    def __init__(self, tp: AxisGroup, min_tokens: int):
        self.tp, self.min_tokens = tp, min_tokens
        self.counts: list[int] | None = None
        """Rows of each member in the current step; None where the step is not split."""
        self.steps_split = 0
        """Steps split since the start."""

    def plan(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` splits (and the rows of each member if so)."""
        p = self.tp.size
        if p == 1 or num_tokens < max(self.min_tokens, p * p):
            self.counts = None
            return False
        m = -(-num_tokens // p)
        self.steps_split += 1
        self.counts = [m] * (p - 1) + [num_tokens - m * (p - 1)]
        return True

    @property
    def split(self) -> bool:
        return self.counts is not None

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """This member's rows of the step's whole `x` (a view)."""
        if self.counts is None:
            return x
        return x[self.counts[0] * self.tp.rank:][:self.counts[self.tp.rank]]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's rows of a split step, in order (x: this member's); else x."""
        return x if self.counts is None else all_gather_rows(x, self.counts, self.tp)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every member's `partial` (num_tokens, ...): this member's rows of it
        on a split step, else all of it (all-reduced in place)."""
        if self.counts is None:
            return reduce_from_tp(partial, self.tp)
        return reduce_scatter_rows(partial, self.counts, self.tp)
