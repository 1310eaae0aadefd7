"""A Llama stage's decoder layers in one C++ call for the eager decode steps of the cpu
backend (kernels/cpu_decode_layers.cpp): the same kernels, in the same order, as the Python
loop of layers/llama.py, without the many op calls a layer makes from Python around them (a
large share of a small model's step at batch 1).

It takes the layers where each op is one of meshserve's C++ kernels: the Llama attention and
MLP as they are (no QKV bias, no per-head norm, no experts), one tensor-parallel rank (no
all-reduce between the layers), a cache in the activations' dtype or int8 (its rows quantized
by the Python path's kernel), and every product one kind of meshserve's own:
- "panels": a weight in its panels (layers/matmul.py DenseCpuMatmul: the avx2 and avx512
  builds, float32 or bf16, no quantization);
- "amx": its AMX product on bf16 weights (AmxCpuMatmul, where the CPU has AMX-BF16, gate/up
  with the activation fused into it);
- "w8a8": its AMX int8 product (layers/quant.py AmxW8A8, where the CPU has AMX-INT8).
"""

from __future__ import annotations

import torch

from meshserve.layers.cpu_backend import CpuBackend
from meshserve.layers.kernels.cpu_library import CpuLibrary
from meshserve.layers.llama import LlamaAttention, LlamaMLP
from meshserve.layers.matmul import AmxCpuMatmul, DenseCpuMatmul
from meshserve.layers.norm import RMSNorm
from meshserve.layers.quant import W8A8Matmul


class FusedDecodeLayers:
    """Runs `layers` (one stage's LlamaDecoderLayers) over a decode-only step."""

    def __init__(self, layers, num_heads: int, num_kv_heads: int, eps: float, scale: float, library: CpuLibrary):
        self.product = _product_kind(layers[0].self_attn.qkv_proj.packed)
        self.weights = [w for layer in layers for w in _layer_weights(layer)]
        self.num_heads, self.num_kv_heads, self.eps, self.scale = num_heads, num_kv_heads, eps, scale
        self.op = library.ops.decode_layers
        gate_up = layers[0].mlp.gate_up_proj
        self.fused_silu = gate_up.applies_silu_mul
        self.lora_batch = gate_up.lora.batch if gate_up.lora is not None else None
        """The step's LoRA slots (layers/lora.py), where the layers have adapters' slots."""
        self.lora = [t for layer in layers for m in _linears(layer) if m.lora is not None for t in (m.lora.a, m.lora.b)]

    def runs(self, kv_caches, meta) -> bool:
        """Whether this step can take the fused call: eager, decode-only, a cache in the
        activations' dtype (the norm weight's) or int8."""
        return (meta.decode_only and not torch.compiler.is_compiling() and bool(kv_caches)
                and kv_caches[0][0].dtype in (self.weights[0].dtype, torch.int8))

    def __call__(self, rope, hidden, residual, kv_caches, meta):
        cos, sin = rope
        slots = self.lora_batch.slots if self.lora_batch is not None else None
        return self.op(hidden.contiguous(), residual, self.weights, [k for k, _ in kv_caches],
                       [v for _, v in kv_caches], cos.contiguous(), sin.contiguous(), meta.slot_mapping,
                       meta.decode_block_tables, meta.decode_lens, self.eps, self.scale, self.num_heads,
                       self.num_kv_heads, self.product, slots, self.lora if slots is not None else [],
                       self.fused_silu, meta.decode_skip)


def _linears(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _layer_weights(layer) -> list[torch.Tensor]:
    attn, mlp = layer.self_attn, layer.mlp
    return [layer.input_layernorm.weight, *_product_tensors(attn.qkv_proj), *_product_tensors(attn.o_proj),
            layer.post_attention_layernorm.weight, *_product_tensors(mlp.gate_up_proj),
            *_product_tensors(mlp.down_proj)]


def _product_tensors(linear) -> list[torch.Tensor]:
    """The product's tensors as the fused call takes them: DenseCpuMatmul's panels, the bf16
    tiles of AmxCpuMatmul, AmxW8A8's int8 tiles with each output's scale and code sum."""
    product = linear.packed
    if isinstance(product, W8A8Matmul):
        return [product.amx.packed, product.amx.scale, product.amx.sums]
    return [product.packed if isinstance(product, AmxCpuMatmul) else product.weight]


def _products(layer) -> set[str | None]:
    """The kinds of product (_product_kind) of a layer's linears; {None} where the layer
    has an op the fused call does not run."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
        return {None}
    if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
        return {None}
    linears = _linears(layer)
    if any(m.bias is not None or m.tp.size != 1 for m in linears):
        return {None}
    if len({m.lora is None for m in linears}) != 1:  # adapters on all four, or none
        return {None}
    kinds = {_product_kind(m.packed) for m in linears}
    # the AMX call takes gate/up with the activation fused (amx_linear_silu) unless adapters
    # add to gate and up before it; the panels' without
    if mlp.gate_up_proj.applies_silu_mul != (kinds == {"amx"} and mlp.gate_up_proj.lora is None):
        return {None}
    return kinds


def _product_kind(product) -> str | None:
    """Which of the fused call's products `product` is: "panels", "amx", "w8a8", or None (none)."""
    if isinstance(product, DenseCpuMatmul):
        return "panels"
    if isinstance(product, AmxCpuMatmul) and not product.float_out:
        return "amx"
    if isinstance(product, W8A8Matmul) and product.amx is not None:
        return "w8a8"
    return None


def fused_decode_layers(model) -> FusedDecodeLayers | None:
    """The fused call for `model` (a LlamaForCausalLM, weights prepared), or None where one
    of its ops is not this library's kernel."""
    layers = list(model.model.layers)
    if not layers or type(model.backend) is not CpuBackend:
        return None
    kinds = set().union(*(_products(layer) for layer in layers))
    if len(kinds) != 1 or None in kinds:  # the op takes one kind of product, of its own
        return None
    eps = {norm.eps for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)}
    if len(eps) != 1:  # the op takes one
        return None
    attn = layers[0].self_attn
    return FusedDecodeLayers(layers, attn.local_num_heads, attn.local_num_kv_heads, eps.pop(), attn.attn.scale,
                             model.backend.library)
