"""Each tensor-parallel layer against its dense twin, on gloo ranks (tp = 2, 3, 4)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshserve.configs.model_info import ModelInfo
from meshserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from meshserve.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear)
from meshserve.layers.llama import LlamaDecoderLayer
from meshserve.layers.rotary import RotaryEmbedding
from meshserve.layers.attention import build_attention_metadata
from meshserve.layers.weights import MemoryTensor
from meshserve.parallel.topology import Topology
from support.dist import run_ranks

HIDDEN, OUT, INTER = 48, 36, 60


def _load(layer, name, tensor, shard=None):
    param = getattr(layer, name)
    param.weight_loader(param, MemoryTensor(tensor), shard)


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def all_gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """All-gathers `x` over the AxisGroup `group`, concatenated along the last dim, on every
    member: a column-parallel output made whole, to compare with the dense layer's."""
    if group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.device_group)
    return torch.cat(parts, dim=-1)


def check_layers(groups, num_heads, num_kv_heads, vocab):
    tp = groups.tp
    g = torch.Generator().manual_seed(0)  # same weights and inputs on every rank
    x = torch.randn(5, HIDDEN, generator=g)
    w, b = torch.randn(OUT, HIDDEN, generator=g), torch.randn(OUT, generator=g)

    col = ColumnParallelLinear(HIDDEN, OUT, tp, bias=True)
    _load(col, "weight", w)
    _load(col, "bias", b)
    _close(all_gather_from_tp(col(x), tp), F.linear(x, w, b))

    w_row = torch.randn(OUT, HIDDEN, generator=g)
    row = RowParallelLinear(HIDDEN, OUT, tp, bias=True)
    _load(row, "weight", w_row)
    _load(row, "bias", b)
    n = HIDDEN // tp.size
    _close(row(x[:, tp.rank * n:(tp.rank + 1) * n].contiguous()), F.linear(x, w_row, b))

    gate, up = torch.randn(INTER, HIDDEN, generator=g), torch.randn(INTER, HIDDEN, generator=g)
    merged = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp)
    _load(merged, "weight", gate, 0)
    _load(merged, "weight", up, 1)
    k = INTER // tp.size
    local_gate, local_up = merged(x).split(k, dim=-1)
    _close(local_gate, F.linear(x, gate)[:, tp.rank * k:(tp.rank + 1) * k])
    _close(local_up, F.linear(x, up)[:, tp.rank * k:(tp.rank + 1) * k])

    head_dim = 8
    wq = torch.randn(num_heads * head_dim, HIDDEN, generator=g)
    wk = torch.randn(num_kv_heads * head_dim, HIDDEN, generator=g)
    wv = torch.randn(num_kv_heads * head_dim, HIDDEN, generator=g)
    qkv = QKVParallelLinear(HIDDEN, head_dim, num_heads, num_kv_heads, tp, bias=False)
    for shard, tensor in (("q", wq), ("k", wk), ("v", wv)):
        _load(qkv, "weight", tensor, shard)
    q, k_, v = qkv(x).split(qkv.local_sizes, dim=-1)
    heads_per_rank = num_heads // tp.size
    _close(q, F.linear(x, wq).view(5, num_heads, head_dim)[:, tp.rank * heads_per_rank:(tp.rank + 1) * heads_per_rank].flatten(1))
    # the KV heads this rank's query heads attend with (GQA grouping), sharded or replicated
    group = num_heads // num_kv_heads
    kv_heads = sorted({h // group for h in range(tp.rank * heads_per_rank, (tp.rank + 1) * heads_per_rank)})
    assert qkv.local_num_kv_heads == len(kv_heads)
    _close(k_, F.linear(x, wk).view(5, num_kv_heads, head_dim)[:, kv_heads].flatten(1))
    _close(v, F.linear(x, wv).view(5, num_kv_heads, head_dim)[:, kv_heads].flatten(1))

    table = torch.randn(vocab, HIDDEN, generator=g)
    ids = torch.tensor([0, 1, vocab - 1, vocab // 2, 7, vocab - 2])
    emb = VocabParallelEmbedding(vocab, HIDDEN, tp)
    _load(emb, "weight", table)
    _close(emb(ids), F.embedding(ids, table))
    head = ParallelLMHead(vocab, HIDDEN, tp)
    _load(head, "weight", table)
    logits = head(x)
    if tp.rank == 0:
        assert logits.shape == (5, vocab)
        _close(logits, F.linear(x, table))
    else:
        assert logits is None
    tied = ParallelLMHead(vocab, HIDDEN, tp, tied_to=emb)
    assert tied.weight is emb.weight
    return True


def count_allreduces_per_layer(groups, num_heads, num_kv_heads):
    """One decoder layer's forward: exactly one all-reduce for attention, one for the MLP."""
    info = ModelInfo("llama", "hf", "", hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                     num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=12, vocab_size=100,
                     rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                     attention_bias=False)
    layer = LlamaDecoderLayer(info, groups.tp, torch.float32)
    rope = RotaryEmbedding(12, 64, 10000.0).lookup(torch.tensor([0, 1, 2, 4]), torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    heads = layer.self_attn.local_num_kv_heads
    cache = (torch.zeros(4, 16, heads, 12), torch.zeros(4, 16, heads, 12))
    meta = build_attention_metadata([3, 1], [3, 5], [[0], [1]], 16)
    calls = []
    original = dist.all_reduce

    def counting(*a, **kw):
        calls.append(1)
        return original(*a, **kw)

    dist.all_reduce = counting  # the gloo path
    before = groups.tp.timer.calls  # every TP collective, shared-memory path included
    try:
        layer(rope, torch.randn(4, HIDDEN), None, cache, meta)
    finally:
        dist.all_reduce = original
    collectives = groups.tp.timer.calls - before
    assert len(calls) == (0 if groups.tp.shm else collectives)
    return collectives


def run_all(groups, num_heads, num_kv_heads, vocab):
    return check_layers(groups, num_heads, num_kv_heads, vocab), count_allreduces_per_layer(groups, num_heads, num_kv_heads)


@pytest.mark.parametrize("tp,num_heads,num_kv_heads,shm", [
    (2, 4, 2, True),    # KV heads sharded
    (4, 4, 2, True),    # KV heads replicated: two ranks share each KV head
    (3, 6, 3, True),    # odd tp
    (2, 4, 2, False),   # collectives over gloo instead of shared memory
])
def test_parallel_layers_match_dense(tp, num_heads, num_kv_heads, shm):
    # 1001: an odd vocabulary, padded to a multiple of tp
    results = run_ranks(run_all, Topology(tp_size=tp), num_heads, num_kv_heads, 1001,
                        shm_slot_bytes=(1 << 20) if shm else 0)
    assert all(ok for ok, _ in results)
    assert [n for _, n in results] == [2] * tp
