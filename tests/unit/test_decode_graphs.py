"""Decode steps from captured graphs (engine/decode_graphs.py), on the CPU through the
stand-in that replays by re-running over the static tensors: bucket selection, padding rows
into a scratch block, the static metadata refreshed in place (tables narrower than the
captured width), the output rows; against the eager model on the same cache."""

from __future__ import annotations

import pytest
import torch

from meshserve.comm.groups import AxisGroup
from meshserve.configs.model_info import read_model_info
from meshserve.engine.decode_graphs import DecodeGraphs, batch_buckets, bucket_for
from meshserve.layers.backend import select_backend
from meshserve.layers.kernels import cpu_library
from meshserve.layers.loader import build_model

BLOCK, BLOCKS, MAX_LEN = 4, 64, 48


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 8]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(33)[-1] == 40
    assert [bucket_for(n, batch_buckets(32)) for n in (1, 3, 5, 9, 17, 32, 33)] == [1, 4, 8, 16, 24, 32, None]


def caches(info, kv_heads, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS + 1, BLOCK, kv_heads, info.head_dim)  # + the scratch block
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(info.num_hidden_layers)]


@pytest.mark.parametrize("kind,backend", [("llama", "torch"), ("qwen3", "cpu")])
def test_graph_steps_equal_eager_steps(tiny_checkpoints, kind, backend):
    info = read_model_info(str(tiny_checkpoints[kind]))
    library = cpu_library.load()
    model = build_model(info, AxisGroup.single("tp"), torch.float32, max_position=MAX_LEN,
                        backend=select_backend(backend, torch.device("cpu"), library), library=library)
    kv_heads = model.model.layers[0].self_attn.local_num_kv_heads
    eager_kv, graph_kv = caches(info, kv_heads, 0), caches(info, kv_heads, 0)
    graphs = DecodeGraphs(model, graph_kv, BLOCK, MAX_LEN, scratch_block=BLOCKS, max_batch=8, device=torch.device("cpu"))
    graphs.capture_all()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    for k, v in graph_kv:  # the captures wrote the scratch block only, then cleared it
        assert not k[BLOCKS].any() and not v[BLOCKS].any()
    for k, v in eager_kv:
        k[BLOCKS].zero_()
        v[BLOCKS].zero_()
    g = torch.Generator().manual_seed(1)
    for n in (1, 3, 5, 8, 2):
        seq_lens = torch.randint(1, MAX_LEN + 1, (n,), generator=g).tolist()
        tables = [torch.randperm(BLOCKS, generator=g)[: -(-s // BLOCK)].tolist() for s in seq_lens]
        ids = torch.randint(0, info.vocab_size, (n,), generator=g).tolist()
        positions = [s - 1 for s in seq_lens]
        assert graphs.fits([1] * n)
        got = graphs.run(torch.tensor(ids), positions, seq_lens, tables).clone()
        meta = model.backend.build_metadata([1] * n, seq_lens, tables, BLOCK)
        with torch.inference_mode():
            want, _ = model(torch.tensor(ids), torch.tensor(positions), eager_kv, meta)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for (gk, gv), (ek, ev) in zip(graph_kv, eager_kv):  # the same slots written, the scratch aside
            torch.testing.assert_close(gk[:BLOCKS], ek[:BLOCKS])
            torch.testing.assert_close(gv[:BLOCKS], ev[:BLOCKS])
    assert graphs.replays == 5
    assert not graphs.fits([1] * 9) and not graphs.fits([2, 1])


def test_an_engine_whose_decode_steps_replay_graphs_generates_the_same(tiny_checkpoints, monkeypatch):
    """The model runner's wiring (graph steps chosen, the rest eager, sampled rows) with the
    stand-in: six prompts of several lengths, a batch that shrinks as they finish, chunked
    prefill beside decodes; the same greedy tokens as without graphs."""
    from meshserve.comm.messages import SamplingParams
    from meshserve.engine import build
    from meshserve.engine.offline import generate
    from support.engines import make_engine

    path = tiny_checkpoints["llama"]
    prompts = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7], list(range(1000, 1023)),
               [9, 99, 999, 9999, 19999], list(range(2000, 2064))]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 20, 7, 16, 25, 10)]
    sets = ("scheduler.max_num_seqs=8", "scheduler.max_batched_tokens=32")
    want = [c.token_ids for c in generate(make_engine(path, *sets), prompts, params)]
    monkeypatch.setattr(build, "uses_decode_graphs", lambda config: True)
    engine = make_engine(path, *sets)
    graphs = engine.executor.runner.decode.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    assert [c.token_ids for c in generate(engine, prompts, params)] == want
    assert graphs.replays > 10
