"""meshserve's AMX product (layers/kernels/cpu_amx_linear.cpp): bf16 weights in AMX tile order
times bf16 rows, float32 sums, against torch's product in float32 of the same numbers; the
matmul plan takes it for bf16 models on the avx512 build where the CPU has AMX-BF16, and
nowhere else. The w8a8 product on AMX's int8 tiles against float64 math on its integer codes.
The products run only on such a CPU (skipped elsewhere, naming the feature);
the plan's choice and the other builds' refusal are checked on any CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshserve.comm.groups import AxisGroup
from meshserve.configs.cpu_features import CpuFeatures, cpu_features
from meshserve.layers import matmul_plan
from meshserve.layers.kernels import cpu_library
from meshserve.layers.kernels.cpu_library import CpuLibrary
from meshserve.layers.linear import ColumnParallelLinear
from meshserve.layers.matmul import AmxCpuMatmul, PackedCpuMatmul
from meshserve.layers.quant import U8_ZERO, AmxW8A8, quantize_int8, quantize_rows_u8
from meshserve.layers.weights import MemoryTensor

AMX = cpu_features().amx_bf16 and cpu_features().runs("avx512")
needs_amx = pytest.mark.skipif(not AMX, reason="needs AMX-BF16 (and the avx512 build)")
SHAPES = [(1, 32, 32), (1, 96, 64), (5, 50, 64), (16, 64, 576), (17, 13, 96), (32, 96, 1536), (33, 80, 576),
          (70, 40, 64), (300, 50, 128), (0, 32, 64)]
"""(rows, out, in): one row, each tile height and past it (16 and 32 rows a pass), outputs
not a multiple of 32 (the last block's padding), the inputs of SmolLM2's products, no rows."""


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> None:
    """Within the bf16 rounding of the output (float32 out: the float32 sums, up to their
    order of summation)."""
    want = F.linear(x.float(), w.float())
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


@pytest.fixture(scope="module")
def avx512() -> CpuLibrary:
    build = cpu_library.load("avx512")
    if build is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    return build


@needs_amx
def test_the_amx_product_matches_torch(avx512):
    g = torch.Generator().manual_seed(0)
    for rows, n, k in SHAPES:
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(rows, k, generator=g).bfloat16()
        packed = avx512.ops.amx_pack(w)
        assert packed.shape == (-(-n // 32), 32 * k) and packed.dtype == torch.bfloat16
        _close(avx512.ops.amx_linear(x, packed, n), x, w)
        _close(avx512.ops.amx_linear_f32(x, packed, n), x, w, torch.float32)
    w = torch.randn(40, 64, generator=g).bfloat16()
    x3 = torch.randn(2, 3, 64, generator=g).bfloat16()
    _close(avx512.ops.amx_linear(x3, avx512.ops.amx_pack(w), 40), x3, w)
    strided = torch.randn(7, 128, generator=g).bfloat16()[:, ::2]  # a view: copied to rows
    _close(avx512.ops.amx_linear(strided, avx512.ops.amx_pack(w), 40), strided, w)


@needs_amx
def test_a_large_output_written_past_the_caches_is_the_same_product(avx512):
    """A prefill-sized output (a megabyte and more) goes to memory in streamed 64-byte lines
    (rounded by AVX512-BF16), each block's rows written out during the next block's k steps:
    the same bits as the product of the same rows a few at a time (outputs written as usual),
    with whole and ragged last blocks, rows whose lines are not 64-byte aligned, and weights
    past one L2 chunk."""
    g = torch.Generator().manual_seed(3)
    for rows, n, k in ((600, 960, 576), (530, 1000, 576), (912, 576, 1536)):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(rows, k, generator=g).bfloat16()
        packed = avx512.ops.amx_pack(w)
        whole = avx512.ops.amx_linear(x, packed, n)
        assert whole.numel() * 2 >= 1 << 20
        pieces = torch.cat([avx512.ops.amx_linear(x[i:i + 48], packed, n) for i in range(0, rows, 48)])
        assert torch.equal(whole, pieces)
        _close(whole, x, w)


@needs_amx
def test_the_amx_product_refuses_what_it_cannot_multiply(avx512):
    w = torch.randn(40, 64).bfloat16()
    packed = avx512.ops.amx_pack(w)
    with pytest.raises(RuntimeError, match="multiple of 32 inputs"):
        avx512.ops.amx_pack(torch.randn(8, 20).bfloat16())
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        avx512.ops.amx_linear(torch.randn(2, 64), packed, 40)
    with pytest.raises(RuntimeError, match="from amx_pack, for inputs of 32"):
        avx512.ops.amx_linear(torch.randn(2, 32).bfloat16(), packed, 40)
    with pytest.raises(RuntimeError, match="65 outputs for a weight of 2 blocks"):
        avx512.ops.amx_linear(torch.randn(2, 64).bfloat16(), packed, 65)


AMX_INT8 = cpu_features().amx_int8 and cpu_features().runs("avx512")


@pytest.mark.skipif(not AMX_INT8, reason="needs AMX-INT8 (and the avx512 build)")
def test_the_amx_int8_product_matches_the_math_on_the_codes(avx512):
    """amx_w8a8_linear against float64 math on the same integer codes and scales, for
    bf16 and float32 rows, the shapes above with 64-multiple inputs (outputs past a block,
    rows past a tile pass, no rows); and its refusals."""
    g = torch.Generator().manual_seed(0)
    for (rows, n, k), dtype in zip([(1, 40, 64), (17, 96, 576), (33, 80, 1536), (70, 50, 128), (0, 32, 64)],
                                   [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]):
        w = torch.randn(n, k, generator=g) * 0.05
        x = torch.randn(rows, k, generator=g).to(dtype)
        codes, scale = quantize_int8(w)
        product = AmxW8A8(codes, scale, avx512)
        assert product.packed.shape == (-(-n // 32), 32 * k) and product.packed.dtype == torch.int8
        got = product(x)
        x_codes, x_scale = quantize_rows_u8(x)
        want = ((x_codes.double() - U8_ZERO) * x_scale.double()) @ (codes.double() * scale.double().view(-1, 1)).t()
        assert got.dtype == dtype and got.shape == (rows, n)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)
    with pytest.raises(RuntimeError, match="multiple of 64 inputs"):
        avx512.ops.amx_pack_s8(torch.zeros(8, 96, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="from amx_pack_s8, for inputs of 128"):
        product(torch.randn(2, 128))


@pytest.mark.parametrize("isa", [isa for isa in ("avx2", "scalar") if cpu_features().runs(isa)])
def test_the_other_builds_refuse_the_amx_ops(isa):
    """Every AMX op is registered in every build and refused outside the avx512 one, with
    arguments it would take there."""
    build = cpu_library.load(isa)
    if build is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    packed = build.ops.amx_pack(torch.randn(40, 64).bfloat16())
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="avx512 build"):
        build.ops.amx_linear(x, packed, 40)
    with pytest.raises(RuntimeError, match="avx512 build"):
        build.ops.amx_linear_f32(x, packed, 40)
    with pytest.raises(RuntimeError, match="avx512 build"):
        build.ops.amx_linear_silu(x, build.ops.amx_pack(torch.randn(64, 64).bfloat16()), 32)
    codes = build.ops.amx_pack_s8(torch.ones(40, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="amx_w8a8_linear runs in the avx512 build"):
        build.ops.amx_w8a8_linear(x, codes, torch.ones(64), torch.zeros(64, dtype=torch.int32), 40)
    q, k, v = (torch.randn(10, heads, 64).bfloat16() for heads in (9, 3, 3))
    with pytest.raises(RuntimeError, match="amx_prefill_attention runs in the avx512 build"):
        build.ops.amx_prefill_attention(q, k, v, torch.tensor([[0, 10]]), 0.125)


AMX_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx2", "avx512_bf16",
                       "amx_tile", "amx_bf16"})


def test_the_plan_takes_the_amx_product_for_bf16_on_amx_cpus(monkeypatch):
    """bf16 on the avx512 build of an AMX CPU; float32, another build, or a CPU without AMX
    keep what they took before (the panels, oneDNN's packed bf16)."""
    avx512, avx2 = CpuLibrary("avx512", None), CpuLibrary("avx2", None)
    monkeypatch.setattr(matmul_plan, "cpu_features", lambda: CpuFeatures(AMX_FLAGS))
    plan = matmul_plan.plan_matmuls("cpu", torch.bfloat16, library=avx512)
    assert isinstance(plan.linear, matmul_plan.AmxTiles) and isinstance(plan.router, matmul_plan.AmxTiles)
    assert plan.head == matmul_plan.AmxTiles(avx512, float_out=True)  # float32 logits
    assert plan.describe() == ("C++ AMX tiles on bfloat16 weights, the head C++ AMX tiles on bfloat16 weights, "
                               "float32 out")
    assert isinstance(matmul_plan.plan_matmuls("cpu", torch.float32, library=avx512).linear, matmul_plan.DensePanels)
    assert not isinstance(matmul_plan.plan_matmuls("cpu", torch.bfloat16, library=avx2).linear, matmul_plan.AmxTiles)
    assert not isinstance(matmul_plan.plan_matmuls("cpu", torch.bfloat16, "int8", avx512).linear,
                          matmul_plan.AmxTiles)
    no_amx = AMX_FLAGS - {"amx_tile", "amx_bf16"}
    monkeypatch.setattr(matmul_plan, "cpu_features", lambda: CpuFeatures(no_amx))
    assert not isinstance(matmul_plan.plan_matmuls("cpu", torch.bfloat16, library=avx512).linear,
                          matmul_plan.AmxTiles)
    assert not CpuFeatures(AMX_FLAGS, known=False).amx_bf16  # never assumed


@needs_amx
def test_a_bf16_linear_on_amx_multiplies_by_tiles(avx512):
    """A layer's weight in tile order replaces the stored one; a weight whose inputs are not
    a multiple of 32 takes oneDNN's packed product."""
    tp = AxisGroup.single("tp")
    g = torch.Generator().manual_seed(1)
    plan = matmul_plan.plan_matmuls("cpu", torch.bfloat16, library=avx512)
    for k, product in ((64, AmxCpuMatmul), (20, PackedCpuMatmul)):
        w = torch.randn(96, k, generator=g).bfloat16()
        col = ColumnParallelLinear(k, 96, tp, dtype=torch.bfloat16)
        col.weight.weight_loader(col.weight, MemoryTensor(w))
        col.pack_weight(plan)
        assert isinstance(col.packed, product) and col.weight.numel() == 0
        x = torch.randn(9, k, generator=g).bfloat16()
        _close(col(x), x, w)


@needs_amx
def test_the_fused_silu_product_gives_the_product_then_silu_and_mul(avx512):
    """amx_linear_silu on a gate/up weight interleaved 16 by 16: bit for bit what amx_linear
    on the weight as stored then silu_and_mul give (one row, a tile pass and past it, SmolLM2's
    shape, no rows); an MLP's gate_up prepared on AMX takes it (half the width out), its
    refusal of a weight whose halves do not fill its blocks, and an MLP whose do not keeps the
    plain product."""
    from types import SimpleNamespace

    from meshserve.layers.llama import LlamaMLP

    g = torch.Generator().manual_seed(4)
    for rows, intermediate, k in ((1, 16, 64), (17, 48, 96), (40, 1536, 576), (0, 32, 64)):
        w = torch.randn(2 * intermediate, k, generator=g).bfloat16() * 0.2
        x = torch.randn(rows, k, generator=g).bfloat16()
        fused = AmxCpuMatmul(w, avx512, silu_mul=True)
        want = avx512.ops.silu_and_mul(AmxCpuMatmul(w, avx512)(x).contiguous())
        got = fused(x)
        assert got.shape == (rows, intermediate) and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="48 outputs are half the 64 rows"):
        avx512.ops.amx_linear_silu(x, avx512.ops.amx_pack(torch.randn(64, 64).bfloat16()), 48)
    plan = matmul_plan.plan_matmuls("cpu", torch.bfloat16, library=avx512)
    tp = AxisGroup.single("tp")
    for intermediate, fused in ((64, True), (40, False)):
        mlp = LlamaMLP(SimpleNamespace(hidden_size=64, intermediate_size=intermediate), tp, torch.bfloat16)
        gate_up = torch.randn(2 * intermediate, 64, generator=g).bfloat16()
        down = torch.randn(64, intermediate, generator=g).bfloat16()
        mlp.gate_up_proj.weight.data.copy_(gate_up)
        mlp.down_proj.weight.data.copy_(down)
        mlp.gate_up_proj.pack_weight(plan)
        mlp.down_proj.pack_weight(plan)
        assert mlp.gate_up_proj.applies_silu_mul == fused
        x = torch.randn(5, 64, generator=g).bfloat16()
        h = F.linear(x.float(), gate_up.float())
        want = F.linear((F.silu(h[:, :intermediate]) * h[:, intermediate:]).bfloat16().float(), down.float())
        got = mlp(x).float()
        assert ((got - want).norm() / want.norm()).item() < 1e-2


@needs_amx
def test_a_bf16_model_on_amx_is_as_close_to_float32_as_transformers_bf16(tiny_checkpoints):
    """The whole model's prompt logits with every product on AMX tiles (chunked too, reading
    the cache) against transformers' float32 ones: no further than transformers' own bf16
    run is; and a compiled decode step (the op's shape function) gives eager's tokens up to
    a near-tie (the float32 logits tell apart what bf16 ones rounded together)."""
    from meshserve.comm.messages import SamplingParams
    from meshserve.engine.offline import generate
    from support.engines import make_engine
    from support.reference import hf_logits, hf_model, meshserve_logits

    path = tiny_checkpoints["llama"]
    prompts = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341))]
    exact = [hf_logits(hf_model(path), p) for p in prompts]
    hf16 = [hf_logits(hf_model(path, torch.bfloat16), p).float() for p in prompts]
    for ours in (meshserve_logits(path, prompts, torch.bfloat16),
                 meshserve_logits(path, prompts, torch.bfloat16, chunk=5, block_size=4)):
        for got, ref, want in zip(ours, hf16, exact):
            err, hf_err = ((got.float() - want).norm() / want.norm()).item(), ((ref - want).norm() / want.norm()).item()
            assert err < 2 * hf_err + 1e-3, (err, hf_err)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2) for _ in prompts]
    eager = make_engine(path, "model.dtype=bfloat16")
    assert "C++ AMX tiles" in eager.executor.runner.model.matmuls.describe()
    head = eager.executor.runner.model.lm_head
    assert head.packed.float_out and head(torch.randn(3, head.weight.shape[1]).bfloat16()).dtype == torch.float32
    compiled = make_engine(path, "model.dtype=bfloat16", "device.compile=true")
    for want, got in zip(generate(eager, prompts, params), generate(compiled, prompts, params)):
        same = next((i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b), None)
        if same is not None:  # the graph's fused bf16 ops round apart from eager's: only a near-tie may flip
            (_, first), (_, second) = want.logprobs[same].top
            assert first - second < 0.05, (same, want.logprobs[same].top, got.logprobs[same].top)
