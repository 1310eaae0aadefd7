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
