"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from meshserve.layers.weights import CheckpointTensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The torch reference. Without `residual`: norm(x). With it: (norm(x + residual),
    x + residual), the second being the next residual."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * h.to(x.dtype)
    return normed if residual is None else (normed, x)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in float32 as Hugging Face does.
    `backend` (meshserve.layers.backend) may compute it with a fused kernel."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32, backend=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.impl = rms_norm if backend is None else backend.rms_norm

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        with torch.no_grad():
            param.copy_(loaded.load())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the
        second being the next residual."""
        return self.impl(x, self.weight, self.eps, residual)
