"""device.compile: decode steps through torch.compile give what the eager model and
transformers give, for one stream, a batch, a block table one block wide and short and
long contexts, with int4 and w8a8 weights too; and no step needs a recompile after warm-up.
device.compile=auto compiles only where the eager steps are not the fused C++ layers."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import SamplingParams
from meshserve.configs import ConfigError, load_config
from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.validate import check_config
from meshserve.engine.build import decode_compile
from meshserve.engine.offline import generate
from support.cpu import needs_vnni
from support.engines import make_engine
from support.reference import hf_greedy, hf_model

pytestmark = pytest.mark.slow

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7], list(range(1000, 1023))]
NEW_TOKENS = [12, 20, 30, 16]


def test_compiled_decode_matches_transformers_alone_and_batched(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    ref = hf_model(path)
    want = [hf_greedy(ref, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
    engine = make_engine(path, "device.compile=true", "cache.block_size=4")
    compiled = engine.executor.runner.decode.compiled
    assert compiled is not None and compiled.compile_seconds > 0
    alone = [generate(engine, [p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids
             for p, n in zip(PROMPTS, NEW_TOKENS)]
    batched = [c.token_ids for c in generate(engine, PROMPTS, [SamplingParams(max_tokens=n, temperature=0,
                                                                              ignore_eos=True) for n in NEW_TOKENS])]
    assert alone == want
    assert batched == want
    assert compiled.steps >= sum(NEW_TOKENS) - len(PROMPTS)
    assert compiled.eager_steps == 0


def test_the_background_compile_serves_eagerly_then_switches_to_the_graphs(tiny_checkpoints):
    """device.compile_wait=false (the default): the engine is built before the graphs; its
    steps meanwhile are eager (and right), and once the compile thread is done decode
    steps run the graphs and give transformers' tokens; the warm-up wrote only its scratch
    block, never a block a sequence holds."""
    path = tiny_checkpoints["llama"]
    ref = hf_model(path)
    want = [hf_greedy(ref, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
    engine = make_engine(path, "device.compile=true", "device.compile_wait=false", "cache.block_size=4")
    runner = engine.executor.runner
    assert runner.decode.compile_thread is not None and runner.decode.compiled is None  # compiling takes seconds
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in NEW_TOKENS]
    while_compiling = [c.token_ids for c in generate(engine, PROMPTS, params)]
    runner.decode.compile_thread.join(timeout=600)
    assert runner.decode.compiled is not None and runner.decode.compiled.compile_seconds > 0
    compiled = [c.token_ids for c in generate(engine, PROMPTS, params)]
    assert while_compiling == want and compiled == want
    assert runner.decode.compiled.steps >= max(NEW_TOKENS) - 1 and runner.decode.compiled.eager_steps == 0  # one batch


@pytest.mark.parametrize("quantization", ["int4", pytest.param("w8a8", marks=needs_vnni)])
def test_compiled_decode_with_quantized_weights_matches_eager(tiny_checkpoints, quantization):
    """device.compile=auto compiles here: the torch backend's eager steps are the Python loop."""
    path = tiny_checkpoints["llama-untied"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0) for n in NEW_TOKENS]
    # NOTE: w8a8 rounds each activation to 8 bits, so a 1e-7 difference between the cpu
    # backend's eager C++ RMSNorm and the compiled graph's can flip a code and move a
    # logprob by ~1e-2; the torch backend's eager ops are the graph's, which isolates compile.
    settings = [f"model.quantization={quantization}", "model.dtype=float32", "device.kernels=torch"]
    eager = generate(make_engine(path, *settings), PROMPTS, params)
    engine = make_engine(path, *settings, "device.compile=auto")
    compiled = generate(engine, PROMPTS, params)
    assert [c.token_ids for c in compiled] == [c.token_ids for c in eager]
    for a, b in zip(compiled, eager):
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-3
    assert engine.executor.runner.decode.compiled.steps > 0 and engine.executor.runner.decode.compiled.eager_steps == 0


def test_compile_is_refused_with_several_ranks_and_auto_stays_eager_there(tiny_checkpoints):
    with pytest.raises(ConfigError, match=r"device.compile=true runs on one CPU rank; here device.type=cpu and 2 ranks"):
        check_config(load_config(None, [f"model.path={tiny_checkpoints['llama']}", "device.compile=true",
                                        "parallel.tensor=2"]))
    config = load_config(None, [f"model.path={tiny_checkpoints['llama']}", "device.compile=auto", "parallel.tensor=2"])
    assert decode_compile(config, check_config(config)) is False


@pytest.mark.skipif(not any(cpu_features().runs(isa) for isa in ("avx512", "avx2")),
                    reason="the fused C++ layers are the vector builds'")
def test_auto_leaves_the_fused_layers_uncompiled(tiny_checkpoints):
    """device.compile=auto where the eager steps run the layers in one C++ call: nothing
    compiles (they serve faster than the compiled step), and the start-up line says so."""
    engine = make_engine(tiny_checkpoints["llama"], "device.compile=auto", "device.compile_wait=false")
    decode = engine.executor.runner.decode
    assert decode.eager.fused is not None and decode.compiled is None and decode.compile_thread is None
    assert decode.describe() == "decode: eager steps: the layers in one C++ call"


def test_a_step_no_graph_fits_runs_eagerly(tiny_checkpoints):
    """int32 ids fail the graphs' guards: the step runs eagerly (counted) and gives the
    eager model's output."""
    import torch

    engine = make_engine(tiny_checkpoints["llama"], "device.compile=true")
    runner = engine.executor.runner
    compiled = runner.decode.compiled
    meta = runner.model.backend.build_metadata([1, 1], [5, 9], [[1], [2]], runner.memory.block_size)
    ids, positions = torch.tensor([11, 12], dtype=torch.int32), torch.tensor([4, 8])
    with torch.inference_mode():
        got, _ = compiled(ids, positions, runner.kv_caches, meta)
        want, _ = runner.model(ids.long(), positions, runner.kv_caches, meta)
    assert compiled.eager_steps == 1 and compiled.steps == 0
    torch.testing.assert_close(got, want)
