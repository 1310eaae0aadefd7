"""The packed CPU matmul path (oneDNN's blocked weights) equals the plain one: within bf16
rounding in bfloat16, within float32 reduction-order error in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshserve.comm.groups import AxisGroup
from meshserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from meshserve.layers.kernels import cpu_library
from meshserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshserve.layers.matmul_plan import onednn_packs, plan_matmuls
from meshserve.layers.weights import MemoryTensor

DTYPES = [pytest.param(torch.float32, id="float32"),
          pytest.param(torch.bfloat16, id="bfloat16", marks=pytest.mark.skipif(
              not onednn_packs(torch.bfloat16), reason="no oneDNN bf16 on this CPU"))]
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_linears_match_dense(rows, dtype):
    tp = AxisGroup.single("tp")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    col = ColumnParallelLinear(64, 96, tp, bias=True, dtype=dtype)
    col.weight.weight_loader(col.weight, MemoryTensor(w))
    col.bias.weight_loader(col.bias, MemoryTensor(b))
    want = F.linear(x, w, b)
    plan = plan_matmuls("cpu", dtype, library=cpu_library.load())
    col.pack_weight(plan)
    assert col.packed is not None and col.weight.numel() == 0  # the packed copy replaced the weight
    torch.testing.assert_close(col(x), want, **TOLERANCE[dtype])

    row = RowParallelLinear(64, 96, tp, dtype=dtype)
    row.weight.weight_loader(row.weight, MemoryTensor(w))
    row.pack_weight(plan)
    torch.testing.assert_close(row(x), F.linear(x, w), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_head_packs_and_the_embedding_still_looks_up(dtype):
    """A tied head's packed copy: oneDNN's leaves the embedding its table; meshserve's AVX2
    panels replace it, and the embedding looks its rows up there."""
    from meshserve.layers.matmul import DenseCpuMatmul

    tp = AxisGroup.single("tp")
    table = torch.randn(50, 32).to(dtype)
    emb = VocabParallelEmbedding(50, 32, tp, dtype)
    emb.weight.weight_loader(emb.weight, MemoryTensor(table))
    head = ParallelLMHead(50, 32, tp, dtype, tied_to=emb)
    head.pack_weight(plan_matmuls("cpu", dtype, library=cpu_library.load()))
    assert head.packed is not None
    if isinstance(head.packed, DenseCpuMatmul):
        assert emb.weight.numel() == 0 and emb.weight.table is head.packed
    else:
        assert emb.weight.shape == (50, 32)
    h = torch.randn(3, 32).to(dtype)
    logits = head(h)  # float32 from the AMX head, the model's dtype from the others
    assert logits.dtype in (dtype, torch.float32)
    torch.testing.assert_close(logits.float(), F.linear(h, table).float(), **TOLERANCE[dtype])
    assert torch.equal(emb(torch.tensor([1, 49])), table[[1, 49]])


@pytest.mark.parametrize("rows", [1, 15, 16, 64])
def test_bf16_on_a_cpu_without_bf16_products_widens_many_rows_to_float32(monkeypatch, rows):
    """Without AVX512-BF16/AMX a bf16 weight is multiplied in float32 from WIDEN_ROWS rows
    (torch's bf16 kernel is slower there); the result is the bf16 product's within
    bf16 rounding; with bf16 products the weight is packed (or left) as before."""
    from meshserve.configs.cpu_features import CpuFeatures
    from meshserve.layers import matmul, matmul_plan

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    exact = x.double() @ w.double().t()
    monkeypatch.setattr(matmul_plan, "cpu_features", lambda: CpuFeatures(frozenset({"avx2", "fma", "f16c"})))
    monkeypatch.setattr(matmul_plan, "onednn_packs", lambda dtype: False)
    col = ColumnParallelLinear(64, 96, AxisGroup.single("tp"), dtype=torch.bfloat16)
    col.weight.weight_loader(col.weight, MemoryTensor(w))
    plan = matmul_plan.plan_matmuls("cpu", torch.bfloat16)  # no C++ library: not meshserve's product
    assert "oneDNN float32 on widened weights" in plan.describe()
    col.pack_weight(plan)
    assert isinstance(col.packed, matmul.WidenedCpuMatmul) and col.weight.numel() == 0
    got = col(x)
    assert got.dtype == torch.bfloat16
    assert (got.double() - exact).norm() / exact.norm() < 4e-3
    torch.testing.assert_close(got, F.linear(x, w), **TOLERANCE[torch.bfloat16])
    monkeypatch.setattr(matmul_plan, "cpu_features", lambda: CpuFeatures(frozenset({"avx2", "fma", "amx_bf16"})))
    assert matmul_plan.plan_matmuls("cpu", torch.bfloat16).linear.product(w) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_dense_kernel_matches_torch_in_every_build(cpu_build, dtype):
    """meshserve's product of a weight in panels (cpu_dense_linear.cpp), in each build this
    CPU runs, against torch's: one row and every tile height (2-6 rows in AVX2's tile, 2-12 in
    AVX-512's, more than a tile, more than a chunk of rows), weights with and without rows past
    the last panel of 16 and with an odd count of panels (AVX-512's tile takes two), a K
    that is odd or not a multiple of 8, leading dimensions, and no rows at all; the panels'
    rows looked up are the weight's."""
    ops = cpu_build.ops
    g = torch.Generator().manual_seed(1)
    for rows, n, k in [(1, 96, 64), (1, 13, 20), (1, 29, 37), (2, 29, 64), (3, 96, 37), (4, 96, 64), (5, 40, 9),
                       (6, 16, 64), (7, 31, 576), (11, 80, 64), (12, 96, 64), (13, 50, 1536), (25, 80, 576),
                       (300, 50, 64), (0, 8, 16)]:
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(rows, k, generator=g).to(dtype)
        panels = ops.pack_panels(w)
        assert panels.shape == w.shape and panels.dtype == dtype
        got = ops.dense_linear(x, panels)
        want = F.linear(x.float(), w.float())
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])
        ids = torch.randint(0, n, (2, 5), generator=g)
        assert torch.equal(ops.panel_rows(panels, ids), w[ids])
        assert torch.equal(ops.panel_rows(panels, ids.int()), w[ids])
    x3 = torch.randn(2, 3, 64, generator=g).to(dtype)
    w = torch.randn(40, 64, generator=g).to(dtype)
    torch.testing.assert_close(ops.dense_linear(x3, ops.pack_panels(w)).float(),
                               F.linear(x3.float(), w.float()), **TOLERANCE[dtype])
    with pytest.raises(RuntimeError, match="outside the 40 rows"):
        ops.panel_rows(ops.pack_panels(w), torch.tensor([40]))


def test_the_vector_builds_multiply_weights_in_panels(cpu_build):
    """The layers take the dense kernel in the avx2 and avx512 builds (the scalar one keeps
    oneDNN), keep one copy of the weight (the panels replace it; a tied embedding looks its rows up
    in the head's), and match torch's product and lookup."""
    from meshserve.layers import matmul

    tp = AxisGroup.single("tp")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=g)
    col = ColumnParallelLinear(64, 96, tp, dtype=torch.float32)
    col.weight.weight_loader(col.weight, MemoryTensor(w))
    plan = plan_matmuls("cpu", torch.float32, library=cpu_build)
    col.pack_weight(plan)
    assert isinstance(col.packed, matmul.DenseCpuMatmul) == (cpu_build.isa in matmul.DENSE_ISAS)
    for rows in (1, 5, 64):
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(col(x), F.linear(x, w), **TOLERANCE[torch.float32])
    table = torch.randn(50, 32, generator=g)
    emb = VocabParallelEmbedding(50, 32, tp, torch.float32)
    emb.weight.weight_loader(emb.weight, MemoryTensor(table))
    head = ParallelLMHead(50, 32, tp, torch.float32, tied_to=emb)
    head.pack_weight(plan)
    if cpu_build.isa in matmul.DENSE_ISAS:
        assert emb.weight.numel() == 0 and emb.weight.table is head.packed  # one copy, the head's
    h = torch.randn(3, 32, generator=g)
    torch.testing.assert_close(head(h), F.linear(h, table), **TOLERANCE[torch.float32])
    ids = torch.tensor([0, 17, 49, 3])
    assert torch.equal(emb(ids), table[ids])


def test_a_float32_weight_of_bf16_numbers_is_kept_in_bf16(cpu_build):
    """In the avx2 and avx512 builds a float32 weight whose every element is a bf16 number (a bf16
    checkpoint read in float32) is kept in bf16 panels: the products are the float32
    weight's (the widening is exact) at every tile height, in float32; the
    rows looked up are the weight's, in float32. A weight with one float32-only element stays
    float32; MBU counts the bytes kept."""
    from meshserve.configs.model_info import ModelInfo
    from meshserve.engine.perf import ModelCost
    from meshserve.layers import matmul

    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g).bfloat16().float()
    assert matmul.bf16_exact(w) and not matmul.bf16_exact(w.bfloat16()) and not matmul.bf16_exact(w[:0])
    almost = w.clone()
    almost[40, 7] += almost[40, 7].abs() * 2 ** -12
    assert not matmul.bf16_exact(almost) and not matmul.bf16_exact(torch.randn(8, 8, generator=g))
    assert matmul.bf16_exact(w, chunk=100) and not matmul.bf16_exact(almost, chunk=100)
    col = ColumnParallelLinear(64, 96, AxisGroup.single("tp"), dtype=torch.float32)
    col.weight.weight_loader(col.weight, MemoryTensor(w))
    plan = plan_matmuls("cpu", torch.float32, library=cpu_build)
    col.pack_weight(plan)
    if cpu_build.isa not in matmul.DENSE_ISAS:
        assert not isinstance(col.packed, matmul.DenseCpuMatmul)
        return
    assert col.packed.weight.dtype == torch.bfloat16 and col.packed.dtype == torch.float32
    for rows in (1, 5, 6, 11, 12, 13, 64, 500):
        x = torch.randn(rows, 64, generator=g)
        got = col(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x, w), **TOLERANCE[torch.float32])
    ids = torch.tensor([0, 95, 17])
    assert torch.equal(col.packed.rows(ids), w[ids])
    assert plan.kept_in_bf16() == (1, 1) and "kept in bf16" in plan.describe()
    assert matmul.DenseCpuMatmul(almost, cpu_build).weight.dtype == torch.float32
    info = ModelInfo(architecture="LlamaForCausalLM", format="hf", path="", hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100,
                     rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True,
                     attention_bias=False)
    assert ModelCost(info, 4, weight_dtype_bytes=2).weight_bytes == ModelCost(info, 2).weight_bytes
    assert ModelCost(info, 4).weight_bytes == 2 * ModelCost(info, 2).weight_bytes
