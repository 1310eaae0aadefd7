"""PEFT adapters read and checked against the base model (engine/lora/adapter.py): the
pairs PEFT saved, with PEFT's scaling (alpha / r, alpha / sqrt(r) with rsLoRA); the delta
x A^T B^T * scaling equals what merge_and_unload adds to each weight; a rank above
lora.max_rank, a target the model lacks, a shape that does not match and trained biases are
refused with the numbers."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshserve.configs.model_info import read_model_info
from meshserve.engine.lora.adapter import AdapterError, read_adapter
from support.lora import make_adapter, merged_model


@pytest.fixture(scope="module")
def base(tiny_checkpoints):
    return tiny_checkpoints["llama"]


def test_the_pairs_and_the_scaling_are_what_peft_merges(base, tmp_path):
    info = read_model_info(str(base))
    path = make_adapter(base, tmp_path / "a", rank=4, alpha=12.0)
    adapter = read_adapter("a", path, info, max_rank=16)
    assert adapter.rank == 4 and adapter.scaling == 3.0
    assert len(adapter.weights) == 7 * info.num_hidden_layers
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    merged = merged_model(base, path)
    for (layer, module), (a, b) in adapter.weights.items():
        part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
        before = getattr(getattr(plain.model.layers[layer], part), module).weight
        after = getattr(getattr(merged.model.layers[layer], part), module).weight
        torch.testing.assert_close(after - before, adapter.scaling * (b @ a), rtol=1e-4, atol=1e-5)
    rs = read_adapter("rs", make_adapter(base, tmp_path / "rs", rank=4, alpha=12.0, use_rslora=True), info, 16)
    assert rs.scaling == pytest.approx(12.0 / math.sqrt(4))


def test_what_the_model_cannot_serve_is_refused_with_the_numbers(base, tmp_path):
    info = read_model_info(str(base))
    path = make_adapter(base, tmp_path / "a", rank=8, targets=["q_proj", "v_proj"])
    with pytest.raises(AdapterError, match=r"'a' has rank 8; this server takes ranks 1..4 \(lora.max_rank\)"):
        read_adapter("a", path, info, max_rank=4)
    weights = load_file(path / "adapter_model.safetensors")
    key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    save_file({**weights, key: weights[key][:, :-1].contiguous()}, path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"q_proj has A \(8, \d+\) and B \(\d+, 8\); this model needs A \(8, "):
        read_adapter("a", path, info, max_rank=16)
    biased = make_adapter(base, tmp_path / "b", rank=2, targets=["q_proj"], bias="lora_only")
    with pytest.raises(AdapterError, match="trains biases"):
        read_adapter("b", biased, info, max_rank=16)
    config = json.loads((biased / "adapter_config.json").read_text())
    (biased / "adapter_config.json").write_text(json.dumps({**config, "bias": "none"}))
    wrong = load_file(biased / "adapter_model.safetensors")
    save_file({k.replace("q_proj", "lm_head"): v for k, v in wrong.items() if "lora_" in k},
              biased / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="is not a LoRA pair of a layer's|targets 'lm_head'"):
        read_adapter("b", biased, info, max_rank=16)
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        read_adapter("c", tmp_path / "nowhere", info, max_rank=16)
