"""Qwen3 and Qwen3-MoE: the Llama decoder with an RMSNorm over each head's query and key
before rotary (q_norm, k_norm: one weight of head_dim, shared by the heads). Qwen3-MoE's
sparse layers (`decoder_sparse_step`, less `mlp_only_layers`) replace the MLP by a block of
experts with top-k softmax routing, renormalized when `norm_topk_prob` (layers.moe)."""

from __future__ import annotations

import torch
from torch import nn

from meshserve.comm.groups import AxisGroup
from meshserve.configs.model_info import ModelInfo
from meshserve.layers.backend import Backend
from meshserve.layers.llama import LlamaAttention, LlamaForCausalLM
from meshserve.layers.moe import DOWN, GATE, UP
from meshserve.layers.norm import RMSNorm


class Qwen3Attention(LlamaAttention):
    def __init__(self, info: ModelInfo, tp: AxisGroup, dtype: torch.dtype, backend: Backend | None = None):
        super().__init__(info, tp, dtype, backend)
        self.q_norm = RMSNorm(info.head_dim, info.rms_norm_eps, dtype, backend)
        self.k_norm = RMSNorm(info.head_dim, info.rms_norm_eps, dtype, backend)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (num_tokens, heads, head_dim): each head's row normalized on its own
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return q, k


class Qwen3ForCausalLM(LlamaForCausalLM):
    EXPERT_PARTS = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}

    def make_attention(self, dtype: torch.dtype) -> nn.Module:
        return Qwen3Attention(self.info, self.tp, dtype, self.backend)
