"""The packed CPU matmul path (oneDNN's blocked weights) equals the plain one: within bf16
rounding in bfloat16, within float32 reduction-order error in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshserve.comm.groups import AxisGroup
from meshserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from meshserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshserve.layers.matmul import packing_helps
from meshserve.layers.weights import MemoryTensor

DTYPES = [pytest.param(torch.float32, id="float32"),
          pytest.param(torch.bfloat16, id="bfloat16", marks=pytest.mark.skipif(
              not packing_helps(torch.empty(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 on this CPU"))]
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
    col.pack_weight()
    assert col.packed is not None and col.weight.numel() == 0  # the packed copy replaced the weight
    torch.testing.assert_close(col(x), want, **TOLERANCE[dtype])

    row = RowParallelLinear(64, 96, tp, dtype=dtype)
    row.weight.weight_loader(row.weight, MemoryTensor(w))
    row.pack_weight()
    torch.testing.assert_close(row(x), F.linear(x, w), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_head_packs_but_keeps_the_embedding(dtype):
    tp = AxisGroup.single("tp")
    table = torch.randn(50, 32).to(dtype)
    emb = VocabParallelEmbedding(50, 32, tp, dtype)
    emb.weight.weight_loader(emb.weight, MemoryTensor(table))
    head = ParallelLMHead(50, 32, tp, dtype, tied_to=emb)
    head.pack_weight()
    assert head.packed is not None and emb.weight.shape == (50, 32)
    h = torch.randn(3, 32).to(dtype)
    torch.testing.assert_close(head(h), F.linear(h, table), **TOLERANCE[dtype])
    assert torch.equal(emb(torch.tensor([1, 49])), table[[1, 49]])


@pytest.mark.parametrize("rows", [1, 15, 16, 64])
def test_bf16_on_a_cpu_without_bf16_products_widens_many_rows_to_float32(monkeypatch, rows):
    """Without AVX512-BF16/AMX a bf16 weight is multiplied in float32 from WIDEN_ROWS rows
    (torch's bf16 kernel is 3.6-6x slower there); the result is the bf16 product's within
    bf16 rounding; with bf16 products the weight is packed (or left) as before."""
    from meshserve.configs.cpu_features import CpuFeatures
    from meshserve.layers import matmul

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    exact = x.double() @ w.double().t()
    monkeypatch.setattr(matmul, "cpu_features", lambda: CpuFeatures(frozenset({"avx2", "fma", "f16c"})))
    monkeypatch.setattr(matmul, "packing_helps", lambda weight: False)
    col = ColumnParallelLinear(64, 96, AxisGroup.single("tp"), dtype=torch.bfloat16)
    col.weight.weight_loader(col.weight, MemoryTensor(w))
    col.pack_weight()
    assert isinstance(col.packed, matmul.WidenedCpuMatmul) and col.weight.numel() == 0
    got = col(x)
    assert got.dtype == torch.bfloat16
    assert (got.double() - exact).norm() / exact.norm() < 4e-3
    torch.testing.assert_close(got, F.linear(x, w), **TOLERANCE[torch.bfloat16])
    monkeypatch.setattr(matmul, "cpu_features", lambda: CpuFeatures(frozenset({"avx2", "fma", "amx_bf16"})))
    assert matmul.prepared_matmul(w) is None
