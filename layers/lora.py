"""LoRA adapters on a rank's linear layers: each target layer holds lora.max_loras slots of
stacked A and B (its shard of them), and adds, to each row of a step's batch, the delta of
the adapter in that row's slot (layers/lora_product.py), without merging any weight.

Sharding follows the base layer. A column-parallel layer's output is split: B is split the
same way (QKV by heads, gate/up each by its half), A is whole. A row-parallel layer's input
is split: A is split by its input columns, B is whole, and each rank adds its share of the
delta before the layer's all-reduce, which sums it ((x A^T) B^T is linear in x).

A layer of several modules (QKV, gate/up) multiplies by all their A's at once (stacked:
parts x max_rank rows) and by a block-diagonal B, so a step makes one shrink and one expand
per layer. PEFT's scaling is folded into B when an adapter is loaded. A layer that no
adapter of the step's rows targets is skipped.

The LM head is a column-parallel layer of one part, with a batch of its own (its rows are
the sampled ones); the embedding is in layers/lora_vocab.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.layers.lora_product import add_lora, group_rows

@dataclass(frozen=True)
class LoraPart:
    """One module a layer's output (column-parallel) or input (row-parallel) holds."""

    module: str
    """Its PEFT target name (q_proj, ...)."""
    offset: int
    """Where this rank's share starts in the layer's local output (column) or is 0 (row)."""
    size: int
    """This rank's share's length."""
    start: int
    """Where this rank's share starts in the module's unsharded output (column) or input (row)."""


class LoraBatch:
    """Which slot each row of the step's batch uses, shared by every LoRA layer of a model
    and set once per step (None: no row uses an adapter)."""

    def __init__(self, kernel=None):
        """`kernel(y, x, slots, a, b)`: adds the deltas in place on the device's fused kernel
        (C++ on the CPU, Triton on CUDA), or None: the torch product (one pair of matmuls per
        adapter in use), which scripts/bench_lora.py's kernel comparison shows slower at
        decode and prefill sizes alike."""
        self.kernel = kernel
        self.slots: torch.Tensor | None = None
        self.in_use: frozenset[int] = frozenset()
        """The slots some row uses."""
        self._groups: list | None = None

    def set(self, slots: list[int] | None, device: torch.device) -> None:
        """Each row's slot (-1: none); None: no row has one."""
        self._groups = None
        self.in_use = frozenset(s for s in slots or () if s >= 0)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device) if self.in_use else None

    def uses(self, loaded: list[bool]) -> bool:
        """Whether a row's slot holds weights for a layer whose slots' `loaded` flags these are."""
        return self.slots is not None and any(loaded[s] for s in self.in_use)

    def add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ones: torch.Tensor
            ) -> torch.Tensor:
        """`y` plus each row's (x A^T) B^T, A and B those of the row's slot."""
        if self.kernel is not None:
            y = y.contiguous()
            self.kernel(y, x.contiguous(), self.slots, a, b)
            return y
        return add_lora(y, x, self.slots, a, b, ones, self.groups())

    def groups(self) -> list:
        if self._groups is None:
            self._groups = group_rows(self.slots)
        return self._groups


class LoraStack:
    """A linear layer's adapter slots: A (slots, parts x max_rank, local in) and B (slots,
    local out, parts x max_rank)."""

    def __init__(self, batch: LoraBatch, parts: list[LoraPart], row_parallel: bool, num_slots: int, max_rank: int,
                 local_in: int, local_out: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.parts, self.row_parallel, self.max_rank = batch, parts, row_parallel, max_rank
        width = len(parts) * max_rank
        self.a = torch.zeros(num_slots, width, local_in, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, local_out, width, dtype=dtype, device=device)
        self._ones = torch.ones(num_slots, dtype=dtype, device=device)
        self.loaded = [False] * num_slots
        """Per slot, whether its adapter targets a module of this layer."""

    @property
    def num_bytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.loaded[slot] = False

    def load(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Put an adapter's (A, B) of each module it targets here (unsharded, float32) into
        `slot`, this rank's shard of them; a module it leaves out adds nothing."""
        self.clear(slot)
        for p, part in enumerate(self.parts):
            if part.module not in pairs:
                continue
            a, b = pairs[part.module]
            self.loaded[slot] = True
            r, col = a.shape[0], p * self.max_rank
            if self.row_parallel:
                self.a[slot, col:col + r] = a[:, part.start:part.start + part.size]
                self.b[slot, :, col:col + r] = b * scaling
            else:
                self.a[slot, col:col + r] = a
                self.b[slot, part.offset:part.offset + part.size, col:col + r] = \
                    b[part.start:part.start + part.size] * scaling

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`y` (the base layer's output for `x`) plus each row's delta."""
        if not self.batch.uses(self.loaded):
            return y
        return self.batch.add(y, x, self.a, self.b, self._ones)
