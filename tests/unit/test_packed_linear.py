"""The packed bf16 CPU matmul path equals the plain one within bf16 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshserve.comm.groups import AxisGroup
from meshserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from meshserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshserve.layers.matmul import packing_helps
from meshserve.layers.weights import MemoryTensor

pytestmark = pytest.mark.skipif(not packing_helps(torch.empty(1, dtype=torch.bfloat16)),
                                reason="no oneDNN bf16 on this CPU")


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_linears_match_dense(rows):
    tp = AxisGroup.single("tp")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    col = ColumnParallelLinear(64, 96, tp, bias=True, dtype=torch.bfloat16)
    col.weight.weight_loader(col.weight, MemoryTensor(w))
    col.bias.weight_loader(col.bias, MemoryTensor(b))
    want = F.linear(x, w, b)
    col.pack_weight()
    assert col.packed is not None and col.weight.numel() == 0  # the packed copy replaced the weight
    torch.testing.assert_close(col(x), want, atol=3e-2, rtol=2e-2)

    row = RowParallelLinear(64, 96, tp, dtype=torch.bfloat16)
    row.weight.weight_loader(row.weight, MemoryTensor(w))
    row.pack_weight()
    torch.testing.assert_close(row(x), F.linear(x, w), atol=3e-2, rtol=2e-2)


def test_tied_head_packs_but_keeps_the_embedding():
    tp = AxisGroup.single("tp")
    table = torch.randn(50, 32).bfloat16()
    emb = VocabParallelEmbedding(50, 32, tp, torch.bfloat16)
    emb.weight.weight_loader(emb.weight, MemoryTensor(table))
    head = ParallelLMHead(50, 32, tp, torch.bfloat16, tied_to=emb)
    head.pack_weight()
    assert head.packed is not None and emb.weight.shape == (50, 32)
    h = torch.randn(3, 32).bfloat16()
    torch.testing.assert_close(head(h), F.linear(h, table), atol=3e-2, rtol=2e-2)
    assert torch.equal(emb(torch.tensor([1, 49])), table[[1, 49]])
