"""How a linear layer multiplies: y = x W^T, by the weight as stored (any device), or by
a copy packed once into oneDNN's blocked layout (bfloat16 on CPU, where AMX / AVX-512
bf16 kernels otherwise re-layout the weight on every call: 2x faster at decode sizes)."""

from __future__ import annotations

import torch


class PackedCpuMatmul:
    BATCH_HINT = 32
    """oneDNN picks its kernel for this many rows; any row count stays correct."""

    def __init__(self, weight: torch.Tensor):
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def packing_helps(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())
