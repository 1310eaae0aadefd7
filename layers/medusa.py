"""Medusa heads (Cai et al., 2024): extra heads on the target model's last hidden state
that guess the tokens after the next one, for speculative decoding without a draft model.

Head k (1-based) reads the final-normed hidden state h_t of position t, from which the LM
head takes token t+1, and guesses token t+1+k: logits_k = lm_head(h_t + SiLU(W_k h_t + b_k)),
with `num_layers` such residual blocks in front of the target's own LM head. The heads
share that LM head and never change it, so a head holds hidden**2 weights and no vocabulary
matrix of its own (Medusa-1 with a frozen, shared head).

The file is safetensors: head k's block j as `heads.{k}.{j}.weight` / `.bias` (k from 0),
with metadata `format` (FILE_FORMAT), `hidden_size`, `num_heads` and `num_layers`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

FILE_FORMAT = "meshserve-medusa"


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, dtype=dtype)
        nn.init.zeros_(self.linear.weight)  # a new head starts as the LM head itself: it guesses token t+1
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.hidden_size, self.num_heads, self.num_layers = hidden_size, num_heads, num_layers
        self.heads = nn.ModuleList(nn.Sequential(*(ResidualBlock(hidden_size, dtype) for _ in range(num_layers)))
                                   for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) final-normed states -> (num_heads, rows, hidden): what the LM head
        turns into each head's logits."""
        return torch.stack([head(hidden) for head in self.heads])

    def save(self, path: Path | str) -> None:
        tensors = {f"heads.{k}.{j}.{part}": getattr(block.linear, part).detach().contiguous()
                   for k, head in enumerate(self.heads) for j, block in enumerate(head) for part in ("weight", "bias")}
        meta = {"format": FILE_FORMAT, "hidden_size": str(self.hidden_size), "num_heads": str(self.num_heads),
                "num_layers": str(self.num_layers)}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Path | str, hidden_size: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> MedusaHeads:
        """The heads in `path`, checked against the target's `hidden_size`."""
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            if meta.get("format") != FILE_FORMAT:
                raise ValueError(f"{path}: not a Medusa heads file (metadata format={meta.get('format')!r}, "
                                 f"expected {FILE_FORMAT!r}; scripts/train_heads.py writes one)")
            if int(meta["hidden_size"]) != hidden_size:
                raise ValueError(f"{path}: heads for hidden_size={meta['hidden_size']}, the model has {hidden_size}")
            heads = cls(hidden_size, int(meta["num_heads"]), int(meta["num_layers"]), dtype)
            with torch.no_grad():
                for name, param in heads.named_parameters():
                    k, j, part = _file_name(name)
                    param.copy_(f.get_tensor(f"heads.{k}.{j}.{part}"))
        heads.requires_grad_(False)
        return heads


def _file_name(param_name: str) -> tuple[str, str, str]:
    """heads.{k}.{j}.linear.{part} (the module's name) -> (k, j, part)."""
    _, k, j, _, part = param_name.split(".")
    return k, j, part
