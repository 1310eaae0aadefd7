"""A LoRA adapter's weights, read once configs/adapters.py has checked it against the model.
Plain torch on the CPU: the ranks take their shards from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from meshserve.configs.adapters import TARGETS, AdapterError, check_adapter, module_shape
from meshserve.configs.model_info import ModelInfo

__all__ = ["TARGETS", "AdapterError", "LoraAdapter", "module_shape", "read_adapter"]


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """(layer, module) -> (A (r, in), B (out, r)), float32 (layer VOCAB_LAYER: the embedding's
    and the LM head's)."""


def read_adapter(name: str, path: str | Path, info: ModelInfo, max_rank: int) -> LoraAdapter:
    """The adapter at `path` (configs.adapters.check_adapter's checks), its weights in float32."""
    spec = check_adapter(name, path, info, max_rank)
    weights = {}
    with safe_open(spec.weights_file, "pt", device="cpu") as f:
        for target, (a_key, b_key) in spec.tensors.items():
            weights[target] = (f.get_tensor(a_key).to(torch.float32), f.get_tensor(b_key).to(torch.float32))
    return LoraAdapter(name, spec.path, spec.rank, spec.scaling, weights)
