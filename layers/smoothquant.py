"""SmoothQuant (Xiao et al., 2023) for the w8a8 linears: a few input channels of the
linear layers carry most of the activations' range, so quantizing each row of activations
to 8 bits by its absmax leaves the other channels a handful of levels. Dividing channel j
of the input by s_j and multiplying column j of the weight by s_j leaves the product
unchanged and moves range from the activations to the weights, with
s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) from one calibration forward.

The division is folded into what produces the input: the RMSNorm weights before qkv_proj
and gate_up_proj, the up_proj rows before down_proj (silu(gate) * up is linear in up).
o_proj is left alone: its inputs quantize well as they are (SmolLM2: perplexity 36.19 with
o_proj alone in w8a8 vs 36.31 unquantized; 36.82 and 36.99 for qkv_proj and down_proj).
"""

from __future__ import annotations

import torch

from meshserve.comm.collectives import max_over_tp
from meshserve.comm.groups import AxisGroup

ALPHA = 0.5
"""How much of the range moves to the weights."""


@torch.inference_mode()
def smooth(model, token_ids: list[int], tp: AxisGroup, block_size: int = 16, alpha: float = ALPHA) -> None:
    """Rescale `model`'s (a whole LlamaForCausalLM, loaded and not yet packed) norms and
    weights from one prefill of `token_ids`; every member of `tp` calls this together."""
    layers = model.model.layers
    inputs = {m: None for layer in layers
              for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)}

    def record(module, args):
        top = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0).float()
        inputs[module] = top if inputs[module] is None else torch.maximum(inputs[module], top)

    hooks = [module.register_forward_pre_hook(record) for module in inputs]
    try:
        _prefill(model, token_ids, block_size)
    finally:
        for hook in hooks:
            hook.remove()
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        s = _factors(inputs[attn.qkv_proj], attn.qkv_proj.weight, alpha, tp)
        layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
        attn.qkv_proj.weight.mul_(s)
        s = _factors(inputs[mlp.gate_up_proj], mlp.gate_up_proj.weight, alpha, tp)
        layer.post_attention_layernorm.weight.div_(s.to(layer.post_attention_layernorm.weight.dtype))
        mlp.gate_up_proj.weight.mul_(s)
        s = _factors(inputs[mlp.down_proj], mlp.down_proj.weight, alpha, None)
        up = mlp.gate_up_proj.weight[mlp.gate_up_proj.weight.shape[0] // 2:]
        up.div_(s[:, None])
        mlp.down_proj.weight.mul_(s)


def _factors(act_max: torch.Tensor, weight: torch.Tensor, alpha: float, tp: AxisGroup | None) -> torch.Tensor:
    """s_j per input channel. The weight's column maxima span every tensor-parallel rank's
    rows when the input is replicated (`tp`), and so do the input's maxima (with sequence
    parallelism a rank saw only its rows of it); a row-parallel layer's columns are local."""
    w_max = weight.abs().amax(0).float()
    if tp is not None:
        max_over_tp(w_max, tp)
        max_over_tp(act_max, tp)
    tiny = 1e-5
    return (act_max.clamp_min(tiny).pow(alpha) / w_max.clamp_min(tiny).pow(1 - alpha)).to(weight.dtype)


def _prefill(model, token_ids: list[int], block_size: int) -> None:
    layers = model.model.layers
    n = len(token_ids)
    blocks = -(-n // block_size)
    attn = layers[0].self_attn
    shape = (blocks, block_size, attn.local_num_kv_heads, attn.head_dim)
    dtype = model.model.dtype
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in layers]
    meta = model.backend.build_metadata([n], [n], [list(range(blocks))], block_size)
    model(torch.tensor(token_ids), torch.arange(n), caches, meta)
