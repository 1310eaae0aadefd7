"""LoRA adapters for the tests, made by PEFT on a base checkpoint with random LoRA weights
of a non-trivial scale (PEFT starts B at zero, which would change nothing), and the oracle:
the base with the adapter merged (`merge_and_unload`)."""

from __future__ import annotations

from pathlib import Path

import torch

TARGETS_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, directory: Path, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                 targets: list[str] | None = None, std: float = 0.2, **config) -> Path:
    """A PEFT adapter of `base` (a Hugging Face checkpoint directory) saved in `directory`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or TARGETS_ALL,
                                                  lora_dropout=0.0, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(str(directory))
    return directory


def merged_model(base: Path, adapter: Path):
    """transformers' base model with the adapter merged into its weights, float32, eval."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
