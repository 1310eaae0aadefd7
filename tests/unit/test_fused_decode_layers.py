"""The decoder layers in one C++ call for eager decode steps (layers/fused_decode.py):
taken in the avx2 and avx512 builds where every op is one of meshserve's kernels (bf16 weights
where meshserve's panels or its AMX tiles multiply them, not oneDNN), it gives the tokens of
the Python loop over the layers and of transformers, alone and batched, in float32 and
bfloat16, with the cache in the activations' dtype or int8; w8a8 on AMX's int8 tiles gives
the loop's tokens; a later pipeline stage's input (a residual given) gives the loop's hidden
states and cache rows; models it does not cover keep the Python loop."""

from __future__ import annotations

import pytest
import torch

from meshserve.comm.messages import SamplingParams
from meshserve.configs.cpu_features import cpu_features
from meshserve.engine.offline import generate
from meshserve.layers.attention import set_tree_skips
from support.checkpoints import make_checkpoint
from support.engines import make_engine
from support.reference import hf_greedy, hf_model

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7]]
NEW_TOKENS = [12, 20, 30]
AVX2 = ("model.dtype=float32", "device.cpu_isa=avx2", "cache.block_size=4", "cache.prefix_caching=false")

VECTOR_ISAS = [isa for isa in ("avx512", "avx2") if cpu_features().runs(isa)]

pytestmark = pytest.mark.skipif(not VECTOR_ISAS, reason="the fused call is the vector builds'")


class Counting:
    """The fused op, counting its calls."""

    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


def _tokens(engine, prompts=PROMPTS, new_tokens=NEW_TOKENS):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in new_tokens]
    return [c.token_ids for c in generate(engine, prompts, params)]


@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cache", ["auto", "int8"])
def test_the_fused_layers_give_the_loop_s_tokens_and_transformers(tiny_checkpoints, dtype, isa, cache):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, *AVX2, f"model.dtype={dtype}", f"device.cpu_isa={isa}", f"cache.dtype={cache}")
    eager = engine.executor.runner.decode.eager
    amx = dtype == "bfloat16" and isa == "avx512" and cpu_features().amx_bf16
    if dtype == "bfloat16" and cpu_features().bf16_compute and not amx:  # bf16 products are oneDNN's there
        assert eager.fused is None and "in panels" not in engine.executor.runner.model.matmuls.describe()
        assert _tokens(engine) == [_tokens(engine, [p], [n])[0] for p, n in zip(PROMPTS, NEW_TOKENS)]
        return
    assert eager.fused is not None and eager.fused.product == ("amx" if amx else "panels")
    counting = eager.fused.op = Counting(eager.fused.op)
    alone = [_tokens(engine, [p], [n])[0] for p, n in zip(PROMPTS, NEW_TOKENS)]
    batched = _tokens(engine)
    assert counting.calls >= sum(NEW_TOKENS) - len(PROMPTS)  # every decode step took it
    eager.fused = None
    assert batched == alone == _tokens(engine)
    if dtype == "float32" and cache == "auto":
        ref = hf_model(path)
        assert batched == [hf_greedy(ref, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]


def test_a_bf16_checkpoint_served_in_float32_keeps_its_weights_in_bf16(tiny_checkpoints, tmp_path):
    """A float32 model of a bf16 checkpoint: every product's weight holds only bf16 numbers
    and is kept in bf16 (the tied embedding's lookups come back in float32); the tokens are
    transformers' float32 ones on the same checkpoint, alone and batched."""
    import shutil

    source = tiny_checkpoints["llama"]
    path = tmp_path / "bf16"
    hf_model(source).to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    for f in source.iterdir():
        if "token" in f.name:
            shutil.copy(f, path / f.name)
    engine = make_engine(path, *AVX2)
    model = engine.executor.runner.model
    kept, dense = model.matmuls.kept_in_bf16()
    assert dense > 0 and kept == dense
    assert "weights in panels kept in bf16" in model.matmuls.describe()
    assert model.model.embed_tokens(torch.tensor([3, 7])).dtype == torch.float32
    assert engine.executor.runner.decode.eager.fused is not None
    ref = hf_model(path)
    assert _tokens(engine) == [hf_greedy(ref, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
    float32 = make_engine(source, *AVX2).executor.runner.model.matmuls
    assert float32.kept_in_bf16() == (0, dense) and "kept in bf16" not in float32.describe()  # float32 numbers stay


@pytest.mark.parametrize("tree", [False, True], ids=["plain", "tree-skips"])
def test_a_later_stage_s_input_gives_the_loop_s_hidden_states_and_cache_rows(tiny_checkpoints, tree):
    """A residual given (a pipeline stage after the first) and some slots of a fresh cache:
    the fused call and the loop write the same K/V rows and return the same (hidden,
    residual); also with a row that skips keys (a draft tree's, attention.set_tree_skips),
    which then differs from the row that sees them all."""
    engine = make_engine(tiny_checkpoints["llama"], *AVX2)
    runner = engine.executor.runner
    model, backend, fused_layers = runner.model.model, runner.model.backend, runner.decode.eager.fused
    info = runner.info
    g = torch.Generator().manual_seed(0)
    n, block = 3, 4
    lens = [5, 9, 2]
    tables = [[0, 1], [2, 3, 4], [5]]
    meta = backend.build_metadata([1] * n, lens, tables, block)
    if tree:
        set_tree_skips(meta, [0, 0b110, 0])
    assert meta.decode_only
    hidden = torch.randn(n, info.hidden_size, generator=g)
    residual = torch.randn(n, info.hidden_size, generator=g)
    positions = torch.tensor([length - 1 for length in lens])
    rope = model.rotary.lookup(positions, torch.float32)
    shape = (8, block, info.num_key_value_heads, info.head_dim)
    caches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in model.layers]
    copies = [(k.clone(), v.clone()) for k, v in caches]
    with torch.no_grad():
        fused = fused_layers(rope, hidden, residual, caches, meta)
        h, r = hidden, residual
        for layer, kv in zip(model.layers, copies):
            h, r = layer(rope, h, r, kv, meta)
    torch.testing.assert_close(fused[0], h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1], r, rtol=1e-5, atol=1e-5)
    for (k, v), (k_ref, v_ref) in zip(caches, copies):
        torch.testing.assert_close(k, k_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v, v_ref, rtol=1e-6, atol=1e-6)
    if tree:
        with torch.no_grad():
            seeing_all = fused_layers(rope, hidden, residual, caches, backend.build_metadata([1] * n, lens, tables, block))
        assert torch.equal(seeing_all[0][[0, 2]], fused[0][[0, 2]]) and not torch.allclose(seeing_all[0][1], fused[0][1])


@pytest.mark.skipif(not (cpu_features().runs("avx512") and cpu_features().amx_int8),
                    reason="the w8a8 products' AMX int8 tiles need AMX-INT8 and the avx512 build")
@pytest.mark.parametrize("cache", ["auto", "int8"])
def test_w8a8_on_amx_int8_tiles_gives_the_loop_s_tokens(tmp_path_factory, cache):
    """The w8a8 config's products (AMX int8 tiles, three tensors a product; every linear's
    inputs a multiple of 64, so none falls back to oneDNN) in the fused call: every decode
    step takes it and the tokens are the Python loop's, alone and batched."""
    path = make_checkpoint(tmp_path_factory.mktemp("w8a8") / "llama", "llama", intermediate_size=128)
    engine = make_engine(path, *AVX2, "model.dtype=bfloat16", "model.quantization=w8a8",
                         "device.cpu_isa=avx512", f"cache.dtype={cache}")
    eager = engine.executor.runner.decode.eager
    assert eager.fused is not None and eager.fused.product == "w8a8"
    assert len(eager.fused.weights) == 14 * len(engine.executor.runner.model.model.layers)
    counting = eager.fused.op = Counting(eager.fused.op)
    alone = [_tokens(engine, [p], [n])[0] for p, n in zip(PROMPTS, NEW_TOKENS)]
    batched = _tokens(engine)
    assert counting.calls >= sum(NEW_TOKENS) - len(PROMPTS)
    eager.fused = None
    assert batched == alone == _tokens(engine)


def test_what_it_does_not_cover_keeps_the_loop(tiny_checkpoints):
    """Per-head norms (Qwen3), quantized weights other than w8a8 on AMX tiles and the scalar
    build leave the model without it."""
    qwen3 = make_engine(tiny_checkpoints["qwen3"], *AVX2)
    assert qwen3.executor.runner.decode.eager.fused is None
    assert "eager steps: the Python layer loop" in qwen3.executor.runner.decode.describe()
    int4 = make_engine(tiny_checkpoints["llama"], *AVX2, "model.quantization=int4")
    assert int4.executor.runner.decode.eager.fused is None
    scalar = make_engine(tiny_checkpoints["llama"], *AVX2, "device.cpu_isa=scalar")
    assert scalar.executor.runner.decode.eager.fused is None


@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_rows_in_the_fused_layers_give_the_loop_s_tokens(tiny_checkpoints, lora_adapters, dtype, isa):
    """Rows of four adapters and none in one decode step: the fused call adds each row's deltas
    after the products as the Python loop does (on AMX, gate/up then leaves the activation to
    silu_and_mul, the deltas added before it)."""
    from support.lora import adapter_settings

    engine = make_engine(tiny_checkpoints["llama-6h"], *AVX2, f"model.dtype={dtype}", f"device.cpu_isa={isa}",
                         *adapter_settings(lora_adapters))
    eager = engine.executor.runner.decode.eager
    if dtype == "bfloat16" and cpu_features().bf16_compute and not cpu_features().amx_bf16:
        assert eager.fused is None  # bf16 products are oneDNN's there
        return
    assert eager.fused is not None and len(eager.fused.lora) == 8 * len(engine.executor.runner.model.model.layers)
    counting = eager.fused.op = Counting(eager.fused.op)
    names = [None, *lora_adapters]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def tokens():
        out = {i: [] for i in range(len(names) * 2)}
        for i in out:
            engine.add_request(i, str(i), PROMPTS[i % 2], params, lora=names[i % len(names)])
        while engine.has_work():
            for key, delta in engine.step():
                out[key] += delta.token_ids
        return list(out.values())

    fused = tokens()
    assert counting.calls >= 10
    eager.fused = None
    assert fused == tokens()
    assert len({tuple(t) for t in fused[:len(names)]}) > 1
