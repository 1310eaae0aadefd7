"""Qwen2-MoE: Qwen2's attention (QKV bias), and in the sparse layers a block of experts
(top-k softmax routing, layers.moe) beside a shared expert every token goes through:

    y = moe(x) + sigmoid(g . x) * shared_expert(x)

The shared expert is a dense MLP split over `tp` like any other and replicated over `ep`;
its partial sum joins the experts' before the block's one all-reduce over `tp`."""

from __future__ import annotations

import torch
from torch import nn

from meshserve.comm.groups import AxisGroup
from meshserve.configs.model_info import ModelInfo
from meshserve.layers.llama import LlamaForCausalLM, LlamaMLP
from meshserve.layers.moe import DOWN, GATE, UP, FusedMoE, Router


class SharedExpertMoE(FusedMoE):
    def __init__(self, info: ModelInfo, tp: AxisGroup, ep: AxisGroup, dtype: torch.dtype, backend=None,
                 exchange: str = "all_to_all"):
        super().__init__(info.hidden_size, info.moe, tp, ep, dtype, backend, exchange)
        self.shared_expert = LlamaMLP(info, tp, dtype, backend, info.moe.shared_expert_intermediate_size)
        self.shared_expert_gate = Router(info.hidden_size, 1, bias=False, dtype=dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x)
        return super().partial(x) + shared


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    EXPERT_PARTS = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}

    def make_mlp(self, layer: int, dtype: torch.dtype) -> nn.Module:
        moe = self.info.moe
        if moe is not None and layer in moe.sparse_layers:
            return SharedExpertMoE(self.info, self.tp, self.ep, dtype, self.backend, self.expert_exchange)
        return super().make_mlp(layer, dtype)
