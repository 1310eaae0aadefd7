"""A rank's side of the adapters: the slots on its model's target layers (and on the
embedding and the LM head, where its stage has them), and the loads the driver's plans ask
for (comm.messages.LoraLoad), each read from the adapter's directory by every rank, which
keeps only its shard."""

from __future__ import annotations

import logging

import torch

from meshserve.configs.adapters import VOCAB_LAYER
from meshserve.configs.model_info import ModelInfo
from meshserve.engine.lora.adapter import read_adapter
from meshserve.layers.lora import LoraBatch, LoraPart, LoraStack
from meshserve.layers.lora_vocab import LoraEmbedding

log = logging.getLogger(__name__)


def target_layers(model) -> list[tuple[int, object]]:
    """(global layer index, linear) of every layer of `model`'s stage an adapter may target."""
    start = model.model.layer_start
    found = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        found += [(start + i, attn.qkv_proj), (start + i, attn.o_proj)]
        if hasattr(mlp, "gate_up_proj"):
            found += [(start + i, mlp.gate_up_proj), (start + i, mlp.down_proj)]
    return found


class RankAdapters:
    def __init__(self, model, info: ModelInfo, num_slots: int, max_rank: int, dtype: torch.dtype, kernel=None):
        """Give each target layer of `model` (built, its weights not yet prepared) its slots,
        in the activations' `dtype`. `kernel`: the device's fused LoRA product (layers/lora.py
        LoraBatch)."""
        self.info, self.max_rank = info, max_rank
        self.batch = LoraBatch(kernel)
        self.head_batch = LoraBatch(kernel)
        """The sampled rows' slots, which the LM head's adapters take."""
        self.layers: list[tuple[int, LoraStack]] = []
        device = next(model.parameters()).device
        for layer, linear in target_layers(model):
            row_parallel = hasattr(linear, "local_input_size")
            local_in, local_out = linear.weight.shape[1], linear.weight.shape[0]
            linear.lora = LoraStack(self.batch, linear.lora_parts(), row_parallel, num_slots, max_rank, local_in,
                                    local_out, dtype, device)
            # the delta joins gate/up before the activation: the product must leave them apart
            linear.may_fuse_silu_mul = False
            self.layers.append((layer, linear.lora))
        self.embedding: LoraEmbedding | None = None
        embed = model.model.embed_tokens
        if embed is not None:
            self.embedding = embed.lora = LoraEmbedding(self.batch, num_slots, max_rank, embed.vocab_start,
                                                        info.vocab_size, embed.local_vocab_size, info.hidden_size,
                                                        dtype, device)
        self.head: LoraStack | None = None
        head = model.lm_head
        if head is not None:
            rows = max(0, min(head.local_vocab_size, info.vocab_size - head.vocab_start))
            self.head = head.lora = LoraStack(self.head_batch, [LoraPart("lm_head", 0, rows, head.vocab_start)], False,
                                              num_slots, max_rank, info.hidden_size, head.local_vocab_size, dtype,
                                              device)

    @property
    def num_bytes(self) -> int:
        held = [stack for _, stack in self.layers] + [s for s in (self.embedding, self.head) if s is not None]
        return sum(s.num_bytes for s in held)

    def load(self, slot: int, name: str, path: str) -> None:
        adapter = read_adapter(name, path, self.info, self.max_rank)
        for layer, stack in self.layers:
            pairs = {part.module: adapter.weights[layer, part.module] for part in stack.parts
                     if (layer, part.module) in adapter.weights}
            stack.load(slot, pairs, adapter.scaling)
        if self.embedding is not None:
            self.embedding.load(slot, adapter.weights.get((VOCAB_LAYER, "embed_tokens")), adapter.scaling)
        if self.head is not None:
            head = adapter.weights.get((VOCAB_LAYER, "lm_head"))
            self.head.load(slot, {} if head is None else {"lm_head": head}, adapter.scaling)
        log.info("LoRA adapter %r (rank %d) loaded into slot %d", name, adapter.rank, slot)


def lora_kernel(device: torch.device, library=None):
    """The device's fused LoRA product (y, x, slots, a, b) -> None, adding in place: the C++
    kernel on the CPU (None without a compiler), Triton's on CUDA."""
    if device.type == "cuda":
        from meshserve.layers.kernels.lora import lora_add

        return lora_add
    return library.ops.lora_add if library is not None else None
