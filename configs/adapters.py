"""LoRA adapters in PEFT's format, checked against the base model without reading their
weights (so before any rank starts, and without torch): a directory with adapter_config.json
(r, lora_alpha, target_modules, use_rslora, ...) and adapter_model.safetensors, whose header
gives each tensor's name and shape (`...layers.<i>.<module>.lora_A.weight`, (r, in), and
`lora_B.weight`, (out, r)). The delta a target module adds to its output is
scaling * x A^T B^T, scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), as PEFT
computes it.

The embedding and the LM head may be targets too. The LM head's pair is a linear layer's
(A (r, hidden), B (vocab, r)); the embedding's is `lora_embedding_A` (r, vocab) and
`lora_embedding_B` (hidden, r), its delta scaling * A^T[id] B^T. PEFT also saves the whole
base weights of those two (`base_layer.weight`, save_embedding_layers): a LoRA target's base
is frozen in training, so they are the model's own and are not read, once their shape shows
the vocabulary was not resized (a resized or trained vocabulary is refused)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from meshserve.configs.model_info import ModelInfo
from meshserve.configs.safetensors_header import read_header

LAYER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The modules of each decoder layer an adapter may target (the attention's and the MLP's projections)."""
VOCAB_TARGETS = ("embed_tokens", "lm_head")
TARGETS = LAYER_TARGETS + VOCAB_TARGETS
VOCAB_LAYER = -1
"""The layer index under which AdapterSpec.tensors files the embedding's and the LM head's pairs."""
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_VOCAB_KEY = re.compile(r"(?:^|\.)(?:embed_tokens\.lora_embedding_([AB])|lm_head\.lora_([AB])\.weight)$")
_BASE_COPY = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.(?:base_layer\.)?weight$")


class AdapterError(ValueError):
    """An adapter this model cannot serve; the message says why, with the numbers."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    rank: int
    scaling: float
    targets: tuple[str, ...]
    tensors: dict[tuple[int, str], tuple[str, str]]
    """(layer, module) -> the names of its A and B in adapter_model.safetensors (layer
    VOCAB_LAYER for the embedding and the LM head)."""

    @property
    def weights_file(self) -> Path:
        return Path(self.path) / "adapter_model.safetensors"


def module_shape(info: ModelInfo, module: str) -> tuple[int, int]:
    """(out, in) of a target module of `info`'s model, unsharded (the embedding's: (hidden,
    vocab), as a lookup of one-hot rows)."""
    h, q, kv = info.hidden_size, info.num_attention_heads * info.head_dim, info.num_key_value_heads * info.head_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (info.intermediate_size, h), "up_proj": (info.intermediate_size, h),
            "down_proj": (h, info.intermediate_size), "embed_tokens": (h, info.vocab_size),
            "lm_head": (info.vocab_size, h)}[module]


def _header(name: str, path: Path) -> dict:
    """The safetensors file's header: tensor name -> {dtype, shape, data_offsets}."""
    try:
        header = read_header(path)
    except ValueError as e:
        raise AdapterError(f"LoRA adapter {name!r}: {path} {e}") from None
    header.pop("__metadata__", None)
    return header


def check_adapter(name: str, path: str | Path, info: ModelInfo, max_rank: int) -> AdapterSpec:
    """The adapter at `path`, checked against `info`'s model: its rank at most `max_rank`,
    every target one of TARGETS that the model has, every A and B of the model's shape (the
    embedding's, (r, vocab) and (hidden, r), fit the same check with module_shape's (out, in))."""
    p = Path(path)
    config_file, weights_file = p / "adapter_config.json", p / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"LoRA adapter {name!r}: {f} is missing (a PEFT adapter directory has "
                               f"adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise AdapterError(f"LoRA adapter {name!r}: {config_file} is not JSON ({e})") from None
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", config.get("r", 0)))
    if not 0 < rank <= max_rank:
        raise AdapterError(f"LoRA adapter {name!r} has rank {rank}; this server takes ranks 1..{max_rank} "
                           f"(lora.max_rank)")
    if info.moe is not None:
        raise AdapterError(f"LoRA adapter {name!r}: adapters on mixture-of-experts models are not served")
    for key in ("fan_in_fan_out", "use_dora"):
        if config.get(key):
            raise AdapterError(f"LoRA adapter {name!r}: {key}=true is not served (plain LoRA only)")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise AdapterError(f"LoRA adapter {name!r} trains biases or whole modules (bias={config.get('bias')!r}, "
                           f"modules_to_save={config.get('modules_to_save')!r}); only LoRA pairs are served")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    for key, entry in _header(name, weights_file).items():
        shape = list(entry.get("shape", []))
        found = _pair_of(name, key, shape, info)
        if found is not None:
            layer, module, which = found
            pairs.setdefault((layer, module), {})[which] = (key, shape)
    tensors = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: {_where(layer, module)} has lora_{'A' if 'A' in pair else 'B'} "
                               f"without its other half")
        out, inp = module_shape(info, module)
        (a_key, a_shape), (b_key, b_shape) = pair["A"], pair["B"]
        if tuple(a_shape) != (rank, inp) or tuple(b_shape) != (out, rank):
            raise AdapterError(f"LoRA adapter {name!r}: {_where(layer, module)} has A {tuple(a_shape)} and B "
                               f"{tuple(b_shape)}; this model needs A ({rank}, {inp}) and B ({out}, {rank})")
        tensors[layer, module] = (a_key, b_key)
    if not tensors:
        raise AdapterError(f"LoRA adapter {name!r} has no LoRA weights")
    return AdapterSpec(name, str(p), rank, scaling, tuple(sorted({m for _, m in tensors})), tensors)


def _where(layer: int, module: str) -> str:
    return module if layer == VOCAB_LAYER else f"layer {layer} {module}"


def _pair_of(name: str, key: str, shape: list[int], info: ModelInfo) -> tuple[int, str, str] | None:
    """(layer, module, "A" or "B") of an adapter's tensor; None for a copy of the base's
    embedding or LM head that PEFT saves beside the pairs; AdapterError for anything else."""
    m = _KEY.search(key)
    if m is not None:
        layer, module = int(m.group(1)), m.group(2)
        if module not in LAYER_TARGETS:
            raise AdapterError(f"LoRA adapter {name!r} targets {module!r}; the model's targets are "
                               f"{', '.join(TARGETS)}")
        if layer >= info.num_hidden_layers:
            raise AdapterError(f"LoRA adapter {name!r} has layer {layer}; the model has "
                               f"{info.num_hidden_layers}")
        return layer, module, m.group(3)
    m = _VOCAB_KEY.search(key)
    if m is not None:
        return (VOCAB_LAYER, "embed_tokens", m.group(1)) if m.group(1) else (VOCAB_LAYER, "lm_head", m.group(2))
    m = _BASE_COPY.search(key)
    if m is not None:
        if tuple(shape) != (info.vocab_size, info.hidden_size):
            raise AdapterError(f"LoRA adapter {name!r} carries {m.group(1)} weights of shape {tuple(shape)}; this "
                               f"model's are ({info.vocab_size}, {info.hidden_size}) (another model's adapter, or a "
                               f"resized vocabulary, which is not served)")
        return None
    raise AdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA pair of a layer's "
                       f"{', '.join(LAYER_TARGETS)} or of the {' or '.join(VOCAB_TARGETS)}")
