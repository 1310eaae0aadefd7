"""meshserve's model against Hugging Face transformers, fp32 prefill logits."""

from __future__ import annotations

import pytest
import torch

from support.checkpoints import KINDS
from support.reference import hf_logits, hf_model, meshserve_logits

PROMPTS = [[1, 504, 3575, 282, 4649, 314], [42] * 3 + list(range(100, 140)), [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


@pytest.mark.parametrize("kind", list(KINDS))
def test_tiny_prefill_logits_match_transformers(tiny_checkpoints, kind):
    path = tiny_checkpoints[kind]
    ref = hf_model(path)
    ours = meshserve_logits(path, PROMPTS)
    for prompt, got in zip(PROMPTS, ours):
        want = hf_logits(ref, prompt)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_chunked_prefill_matches_whole_prefill(tiny_checkpoints):
    path = tiny_checkpoints["llama3-rope"]
    whole = meshserve_logits(path, PROMPTS)
    chunked = meshserve_logits(path, PROMPTS, chunk=5, block_size=4)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_smollm2_gguf_logits_match_transformers(smollm2, smollm2_reference):
    ref = smollm2_reference
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    want = hf_logits(ref, prompt)
    got = meshserve_logits(smollm2, [prompt])[0]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe", "mixtral", "qwen2-moe"])
def test_gguf_of_each_family_matches_its_safetensors(tiny_checkpoints, tmp_path, kind):
    """The same weights as llama.cpp lays them out (expert tensors stacked, Mixtral's Q/K
    permuted as `llama`): the same logits as the Hugging Face directory, which matches
    transformers above. (transformers' own GGUF loader is no oracle here: for qwen3 it reads
    no head_dim, for qwen3_moe no expert_feed_forward_length.)"""
    import gguf

    from meshserve.configs.model_info import read_model_info
    from support.gguf_export import export_gguf

    hf_dir = tiny_checkpoints[kind]
    path = export_gguf(hf_dir, tmp_path / f"{kind}.gguf")
    assert read_model_info(str(path)).moe == read_model_info(str(hf_dir)).moe
    want = meshserve_logits(hf_dir, PROMPTS[:2])
    for got, w in zip(meshserve_logits(path, PROMPTS[:2]), want):
        torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-4)
    if kind == "qwen3-moe":  # quantized 3-D expert data, read one expert's rows at a time
        q8 = export_gguf(hf_dir, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
        for got, w in zip(meshserve_logits(q8, PROMPTS[:2]), want):
            assert (got - w).abs().max() < 0.05 * w.abs().max()
            assert (got.argmax(-1) == w.argmax(-1)).float().mean() > 0.9
