"""The LoRA product of a batch whose rows use different adapters (Punica's and S-LoRA's
shrink-expand pair), without merging any weight: the rows are grouped by adapter slot, and
each group is multiplied once by its adapter's A (shrink: in -> r) and B (expand: r -> out).

    delta[t] = scaling[s] * (x[t] A[s]^T) B[s]^T,   s = slots[t]  (s < 0: no adapter, no delta)

The adapters' weights sit in stacked slots (A: (slots, r, in), B: (slots, out, r)); an
adapter of a rank below r is padded with zeros, which adds nothing. This is the torch
product, the reference the CPU and GPU kernels are tested against."""

from __future__ import annotations

import torch


def group_rows(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, the rows that use it) for each slot in use, rows without an adapter left out."""
    found = torch.unique(slots)
    return [(int(s), torch.nonzero(slots == s).flatten()) for s in found.tolist() if s >= 0]


def lora_delta(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
               groups: list[tuple[int, torch.Tensor]] | None = None) -> torch.Tensor | None:
    """The LoRA delta of each row of `x` (rows, in): (rows, out), or None when no row uses
    an adapter. `groups`: group_rows(slots), when several layers share one batch."""
    groups = group_rows(slots) if groups is None else groups
    if not groups:
        return None
    out = x.new_zeros(x.shape[0], b.shape[1])
    for slot, rows in groups:
        shrunk = x.index_select(0, rows) @ a[slot].to(x.dtype).t()
        out.index_copy_(0, rows, (shrunk @ b[slot].to(x.dtype).t()) * scaling[slot].to(x.dtype))
    return out


def add_lora(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scaling: torch.Tensor, groups: list[tuple[int, torch.Tensor]] | None = None) -> torch.Tensor:
    """`y` (the base layer's output for `x`) plus its rows' LoRA deltas."""
    delta = lora_delta(x, slots, a, b, scaling, groups)
    return y if delta is None else y + delta
