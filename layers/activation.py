"""SwiGLU's activation: silu(gate) * up over the gate/up projection's fused output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The torch reference: x (..., 2n) = [gate, up] -> silu(gate) * up, (..., n)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
