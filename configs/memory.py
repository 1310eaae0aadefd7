"""The memory plan of one rank: weights, KV bytes per token, number of KV blocks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.errors import ConfigError
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.quantization import Quantization
from meshserve.configs.schema import Config
from meshserve.configs.validate import resolved_max_model_len

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
INT4_GROUP = 32


def matmul_bytes_per_param(quantization: Quantization, act_bytes: int) -> float:
    """Bytes a weight-only quantized matmul reads per weight: int4 codes plus a scale and
    a zero per group of 32, int8 codes (one scale per row, negligible), or the dtype's."""
    quantization = Quantization(quantization)
    if quantization is Quantization.INT4:
        return 0.5 + 2 * act_bytes / INT4_GROUP
    if quantization in (Quantization.INT8, Quantization.W8A8):
        return 1.0
    return float(act_bytes)


def int4_dense_copy_bytes_per_param(device_type: str) -> float:
    """Bytes per weight an int4 matmul holds besides what it reads at decode, on a CPU
    without bf16 dot products (meshserve.layers.quant.Int4Matmul): its codes two to a byte
    and a float32 scale and low per group of 32, for the float32 product of prefill chunks."""
    if device_type != "cpu" or cpu_features().bf16_compute:
        return 0.0
    return 0.5 + 2 * 4 / INT4_GROUP


def kv_row_bytes(head_dim: int, kv_dtype: str, act_bytes: int) -> int:
    """Bytes the cache keeps per token, KV head and K or V: head_dim values, or for
    cache.dtype=int8 head_dim codes and a float32 scale (meshserve.layers.kv_quant)."""
    return head_dim + 4 if kv_dtype == "int8" else head_dim * act_bytes


def local_num_kv_heads(num_key_value_heads: int, tp_size: int) -> int:
    """KV heads held by one TP rank: sharded when tp <= kv heads, one replicated head otherwise."""
    return max(1, num_key_value_heads // tp_size)


def head_cost_in_layers(info: ModelInfo) -> float:
    """The LM head's matmul weights over one decoder layer's: what the last stage computes
    beyond its layers for every decoded token."""
    return info.vocab_size * info.hidden_size / info.active_layer_parameters


def layers_per_stage(num_layers: int, pp_size: int, explicit: list[int] | None = None,
                     last_stage_extra: float = 0.0) -> list[int]:
    """The config's split, else one that evens the decode cost of the stages: the last
    stage, which also runs the LM head (`last_stage_extra` layers' worth), takes fewer
    layers; the others split the rest evenly, the first ones taking the remainder."""
    if explicit:
        return list(explicit)
    if pp_size == 1:
        return [num_layers]
    target = (num_layers + last_stage_extra) / pp_size
    last = min(max(1, round(target - last_stage_extra)), num_layers - (pp_size - 1))
    base, rem = divmod(num_layers - last, pp_size - 1)
    return [base + (1 if s < rem else 0) for s in range(pp_size - 1)] + [last]


def stage_layers(config: Config, info: ModelInfo) -> list[int]:
    """Layers per pipeline stage for this config and model."""
    return layers_per_stage(info.num_hidden_layers, config.parallel.pipeline, config.parallel.pipeline_layers,
                            head_cost_in_layers(info))


def stage_layer_range(counts: list[int], stage: int) -> tuple[int, int]:
    """[start, end) of the global layer indices held by `stage`."""
    start = sum(counts[:stage])
    return start, start + counts[stage]


@dataclass(frozen=True)
class MemoryPlan:
    dtype: str
    weight_bytes: int
    """The largest rank's share of the weights."""
    kv_bytes_per_token: int
    """Per rank: K and V of every layer on the rank, local KV heads only."""
    block_size: int
    num_blocks: int
    max_model_len: int
    quantization: Quantization = Quantization.NONE
    """Weight-only quantization of the linear layers (config model.quantization)."""
    kv_dtype: str = "auto"
    """config cache.dtype: `auto` (the cache holds `dtype`) or `int8`."""
    lora_bytes: int = 0
    """The largest rank's LoRA adapter slots (lora.max_loras x lora.max_rank wide), held beside the weights."""

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size * self.num_blocks

    @property
    def kv_cache_tokens(self) -> int:
        return self.block_size * self.num_blocks


def _share(max_len: int, need: int, cp: int) -> str:
    if cp == 1:
        return f"model.max_model_len={max_len}"
    return f"the {need} one rank holds of a model.max_model_len={max_len} sequence at parallel.context={cp}"


def plan_memory(config: Config, info: ModelInfo, source: str = "<builtin default>") -> MemoryPlan:
    tp, pp = config.parallel.tensor, config.parallel.pipeline
    dtype = config.torch_dtype_name
    nbytes = DTYPE_BYTES[dtype]
    h, v = info.hidden_size, info.vocab_size
    embed = math.ceil(v / tp) * h
    # Expert parallelism: a rank holds 1/parallel.expert of the routed experts.
    per_layer = info.layer_parameters - info.expert_layer_parameters * (1 - 1 / config.parallel.expert)
    most_layers = max(stage_layers(config, info))
    # The first stage holds the embedding, the last the LM head (tied: loaded on both ends).
    ends = embed * (1 if (pp > 1 or info.tie_word_embeddings) else 2)
    quantization = config.model.quantization
    # Quantized: the layers' matmuls shrink, and the head gets a quantized copy beside its weight.
    head_copy = embed * matmul_bytes_per_param(quantization.head, nbytes) if quantization.quantized else 0.0
    held_per_param = matmul_bytes_per_param(quantization, nbytes)
    if quantization is Quantization.INT4:
        held_per_param += int4_dense_copy_bytes_per_param(config.device.type)
    weight_bytes = int(most_layers * per_layer / tp * held_per_param + (ends + h) * nbytes + head_copy)

    kv_heads = local_num_kv_heads(info.num_key_value_heads, tp)
    kv_per_token = 2 * most_layers * kv_heads * kv_row_bytes(info.head_dim, config.cache.dtype, nbytes)
    block = config.cache.block_size
    num_blocks = config.cache.num_blocks or int(config.cache.memory) // (kv_per_token * block)
    max_len = resolved_max_model_len(config, info)
    cp = config.parallel.context
    # A rank holds 1/cp of a sequence, give or take the uneven ends of prefill chunks.
    need = max_len if cp == 1 else -(-max_len // cp) + max(2 * cp, max_len // 64)
    if num_blocks * block < need and config.cache.num_blocks:
        raise ConfigError(
            f"{source}: cache.num_blocks={num_blocks} x cache.block_size={block} = {num_blocks * block} tokens per rank, "
            f"fewer than {_share(max_len, need, cp)}; set cache.num_blocks >= {-(-need // block)} "
            f"or lower model.max_model_len")
    if num_blocks * block < need:
        raise ConfigError(
            f"{source}: the KV cache holds {num_blocks} blocks x {block} tokens = {num_blocks * block} tokens per rank, "
            f"fewer than {_share(max_len, need, cp)}; raise cache.memory (now {int(config.cache.memory)} bytes, "
            f"{kv_per_token} bytes per token) or lower model.max_model_len"
        )
    return MemoryPlan(dtype, weight_bytes, kv_per_token, block, num_blocks, max_len, quantization, config.cache.dtype,
                      (lora_slot_bytes(config, info) * most_layers + lora_vocab_slot_bytes(config, info))
                      * config.lora.max_loras if config.lora.active else 0)


def lora_slot_bytes(config: Config, info: ModelInfo) -> int:
    """One layer's share of one LoRA slot on a rank (layers/lora.py LoraStack: each target
    layer's A and B, its modules stacked, lora.max_rank wide each, sharded as the layer is)."""
    tp, r = config.parallel.tensor, config.lora.max_rank
    h, d = info.hidden_size, info.head_dim
    q = info.num_attention_heads * d // tp
    kv = local_num_kv_heads(info.num_key_value_heads, tp) * d
    inter = info.intermediate_size // tp
    params = (3 * r * h + (q + 2 * kv) * 3 * r      # qkv: A whole, B split by heads
              + r * q + h * r                       # o: A split by its input, B whole
              + 2 * r * h + 2 * inter * 2 * r       # gate/up
              + r * inter + h * r)                  # down
    return params * DTYPE_BYTES[config.torch_dtype_name]


def lora_vocab_slot_bytes(config: Config, info: ModelInfo) -> int:
    """One LoRA slot's share on a rank of the embedding and the LM head (layers/lora_vocab.py
    and layers/lora.py: A^T or B split by vocabulary rows, the other whole), counted for
    both, as a rank of one pipeline stage holds."""
    r, h = config.lora.max_rank, info.hidden_size
    local_vocab = -(-info.vocab_size // config.parallel.tensor)
    embedding = local_vocab * r + h * r + r * r  # A^T's rows, B, the identity the expand takes
    head = r * h + local_vocab * r
    return (embedding + head) * DTYPE_BYTES[config.torch_dtype_name]
