"""LoRA adapters for the tests, made by PEFT on a base checkpoint with random LoRA weights
of a non-trivial scale (PEFT starts B at zero, which would change nothing), and the oracle:
the base with the adapter merged (`merge_and_unload`; a tied embedding and LM head untied
first, since the adapter's pairs on each differ)."""

from __future__ import annotations

from pathlib import Path

import torch

TARGETS_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(base: Path):
    """transformers' model of `base` (a Hugging Face directory or a .gguf file), float32, its
    weights ordinary tensors (PEFT merges into them in place)."""
    from transformers import AutoModelForCausalLM

    p = Path(base)
    if p.is_file():
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval()


def make_adapter(base: Path, directory: Path, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                 targets: list[str] | None = None, std: float = 0.2, model=None, **config) -> Path:
    """A PEFT adapter of `base` (a Hugging Face checkpoint directory or a .gguf file) saved in
    `directory`. `model`: transformers' model of `base` already loaded (left as it was)."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(model) if model is not None else base_model(base)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or TARGETS_ALL,
                                                  lora_dropout=0.0, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(str(directory))
    return directory


def merged_model(base: Path, adapter: Path, model=None):
    """transformers' base model with the adapter merged into its weights, float32, eval.
    `model`: transformers' model of `base` already loaded (left as it was)."""
    import copy

    from peft import PeftModel

    model = copy.deepcopy(model) if model is not None else base_model(base)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
        model.config.tie_word_embeddings = False
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


# (name, rank, alpha, seed, targets, extra PEFT options): the tests' adapters of one base
ADAPTERS = [
    ("a0", 8, 16.0, 1, TARGETS_ALL + ["embed_tokens"], {}),
    ("a1", 4, 8.0, 2, ["q_proj", "v_proj"], {}),
    ("a2", 8, 4.0, 3, ["o_proj", "down_proj", "gate_proj"], {"use_rslora": True}),
    ("a3", 2, 4.0, 4, ["k_proj", "up_proj", "lm_head"], {}),
]
PROMPTS = [[5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125, 137, 149, 161, 173, 185, 197, 9, 21],
           [7, 3, 90, 11, 250, 33, 18]]


def make_adapters(base: Path, root: Path) -> dict[str, Path]:
    """ADAPTERS made on `base`, name -> directory under `root`."""
    return {name: make_adapter(base, root / name, rank=r, alpha=alpha, seed=seed, targets=targets, **extra)
            for name, r, alpha, seed, targets, extra in ADAPTERS}


def greedy_oracle(base: Path, adapters: dict[str, Path], max_new_tokens: int):
    """(adapter name or None, prompt ids) -> transformers' greedy tokens with that adapter merged."""
    from support.reference import hf_greedy, hf_model

    models = {None: hf_model(base), **{n: merged_model(base, p) for n, p in adapters.items()}}
    cache = {}

    def expected(name, prompt):
        key = (name, tuple(prompt))
        if key not in cache:
            cache[key] = hf_greedy(models[name], list(prompt), max_new_tokens)
        return cache[key]

    return expected


def adapter_settings(adapters: dict[str, Path], names=None, max_loras: int = 4, max_rank: int = 8) -> list[str]:
    """The config settings (KEY=VALUE) that serve `names` of `adapters` (default: all)."""
    names = list(adapters) if names is None else names
    table = ", ".join(f"{n}: {adapters[n]}" for n in names)
    return [f"lora.adapters={{{table}}}", f"lora.max_loras={max_loras}", f"lora.max_rank={max_rank}",
            "lora.enabled=true"]
