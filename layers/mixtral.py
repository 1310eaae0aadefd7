"""Mixtral: Mistral's attention, and in every layer a block of experts (`block_sparse_moe`,
experts w1 = gate, w3 = up, w2 = down) with top-2 softmax routing, the two probabilities
renormalized to sum to 1 (layers.moe)."""

from __future__ import annotations

from meshserve.layers.llama import LlamaForCausalLM
from meshserve.layers.moe import DOWN, GATE, UP


class MixtralForCausalLM(LlamaForCausalLM):
    EXPERT_PARTS = {"w1": GATE, "w3": UP, "w2": DOWN}
    MOE_BLOCK = "block_sparse_moe"
