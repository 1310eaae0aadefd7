"""The cpu backend's C++ paged decode attention (meshserve.layers.kernels.cpu_attention), in
every build this CPU runs (the `cpu_build` fixture),
against softmax attention in float64 over the same cached tokens: float32, bf16 and
float16; head sizes on its vector path (multiples of 16) and off it; GQA groups of 1 to
6 (its block path takes up to 4 query heads at a time); blocks of up to 16 tokens (the
block path) and of 32; lengths of one token, whole blocks and partial ones; few sequences (a task per KV
head) and many (a task per sequence); inside torch.compile. Then the whole model with the
cpu backend against the torch backend, and the kernel's refusals of bad tables. Queries that
skip some of their last keys (a draft tree's rows) against float64 attention without them,
and the torch backend's dense mask of the same skips.

Its prefill kernel against float64 causal attention per chunk: the same dtypes, head sizes
on and off its vector paths, chunks shorter and longer than its 16-query tiles, strided
q/k/v (views of one fused projection); in bf16 on AMX tiles where the CPU has them (chunks
of 1 to 300 tokens, head sizes 64 to 256); and a step mixing a fresh chunk, a chunk after a
cached prefix and a decode, through the cpu backend against the torch backend."""

from __future__ import annotations

import pytest
import torch

from meshserve.layers import attention
from meshserve.layers.attention import build_attention_metadata, paged_attention
from meshserve.layers.cpu_backend import CpuBackend, build_cpu_metadata
from meshserve.layers.kernels import cpu_attention, cpu_library
from support.kernel_cases import math_attention

pytestmark = pytest.mark.skipif(cpu_library.load() is None, reason="no C++ compiler for the cpu backend's kernel")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture
def two_threads():
    """With 2 threads the kernel gives each KV head its own task below 4 sequences."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def make_case(n, heads, kv_heads, head_dim, block_size, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-length // block_size) for length in lens) + 1  # one padding column
    num_blocks = n * width + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=g)[: n * width].view(n, width)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.long)


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Each sequence's first `len` cached tokens, in float64."""
    n, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.empty(n, heads, head_dim, dtype=torch.float64)
    for i in range(n):
        keys = k_cache[tables[i]].flatten(0, 1)[: lens[i]].double().repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache[tables[i]].flatten(0, 1)[: lens[i]].double().repeat_interleave(heads // kv_heads, dim=1)
        weights = (torch.einsum("hd,khd->hk", q[i].double(), keys) * scale).softmax(-1)
        out[i] = torch.einsum("hk,khd->hd", weights, values)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 2, 24), (12, 2, 64)])
@pytest.mark.parametrize("n,block_size,lens", [(1, 16, [1]), (2, 4, [4, 9]), (3, 16, [16, 33, 200]), (2, 32, [5, 70]),
                                               (12, 8, [1, 2, 7, 8, 9, 15, 16, 17, 40, 63, 64, 100])])
def test_matches_float64_attention(dtype, heads, kv_heads, head_dim, n, block_size, lens, two_threads, cpu_build):
    q, k_cache, v_cache, tables, lens_t = make_case(n, heads, kv_heads, head_dim, block_size, lens, dtype)
    scale = head_dim ** -0.5
    got = cpu_attention.paged_decode_attention(cpu_build, q, k_cache, v_cache, tables, lens_t, scale)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), reference(q, k_cache, v_cache, tables, lens_t, scale),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_non_contiguous_queries_and_tokens_past_the_length_are_ignored(cpu_build):
    q, k_cache, v_cache, tables, lens = make_case(4, 9, 3, 64, 16, [5, 16, 17, 30], torch.float32)
    wide = torch.randn(4, 9, 128)
    wide[..., ::2] = q  # a strided view of the same queries
    want = cpu_attention.paged_decode_attention(cpu_build, q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(cpu_attention.paged_decode_attention(cpu_build, wide[..., ::2], k_cache, v_cache,
                                                                    tables, lens, 0.125), want)
    for i, length in enumerate(lens.tolist()):  # garbage in the cache beyond each length changes nothing
        blocks = tables[i]
        flat = k_cache[blocks].flatten(0, 1)
        flat[length:] = 1e4
        k_cache[blocks] = flat.view(len(blocks), 16, 3, 64)
    torch.testing.assert_close(cpu_attention.paged_decode_attention(cpu_build, q, k_cache, v_cache, tables, lens,
                                                                    0.125), want)


def test_inside_torch_compile_with_dynamic_batch(cpu_build):
    def step(q, k_cache, v_cache, tables, lens):
        return cpu_attention.paged_decode_attention(cpu_build, q * 2, k_cache, v_cache, tables, lens, 0.125) + 1

    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    for n, lens in ((2, [3, 40]), (5, [1, 16, 17, 8, 33])):
        args = make_case(n, 9, 3, 64, 16, lens, torch.float32, seed=n)
        torch.testing.assert_close(compiled(*args), step(*args))


def test_bad_tables_are_refused_with_the_numbers(cpu_build):
    q, k_cache, v_cache, tables, lens = make_case(2, 9, 3, 64, 16, [5, 20], torch.float32)
    op = cpu_build.ops.paged_decode_attention
    with pytest.raises(RuntimeError, match=r"sequence 1 has length 999, its block table holds 48"):
        op(q, k_cache, v_cache, tables, torch.tensor([5, 999]), 0.125)
    with pytest.raises(RuntimeError, match=r"sequence 0 has length 0"):
        op(q, k_cache, v_cache, tables, torch.tensor([0, 5]), 0.125)
    bad = tables.clone()
    bad[1, 1] = 10_000
    with pytest.raises(RuntimeError, match=r"block id 10000 outside the cache's 9 blocks"):
        op(q, k_cache, v_cache, bad, lens, 0.125)
    with pytest.raises(RuntimeError, match="the cache must hold q.s dtype or int8"):
        op(q.double(), k_cache, v_cache, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        op(q, k_cache, v_cache, tables.int(), lens, 0.125)


def test_model_with_cpu_backend_matches_torch_backend(tiny_checkpoints, cpu_build):
    from support.kernel_cases import compare_backends

    r = compare_backends(str(tiny_checkpoints["llama"]), torch.float32, "cpu", other="cpu", library=cpu_build)
    assert r["cpu"] == r["torch"], "greedy tokens differ"
    assert len(r["torch"]) == 3 and all(len(t) == 6 for t in r["torch"])
    assert r["logits_max_diff"] <= 1e-4 * r["logits_scale"], (r["logits_max_diff"], r["logits_scale"])


SPANS = [(3, 5), (8, 16), (24, 17), (41, 100), (141, 1), (142, 33)]
"""(first row, length) of the chunks of one flat batch; rows 0-2 belong to none."""


def fused_projection(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q, k, v as views of one (tokens, heads + 2 kv_heads, head_dim) tensor, as the model's
    fused QKV projection gives them (row stride wider than a row)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    return qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (12, 2, 64), (4, 4, 32), (6, 2, 24)])
def test_prefill_kernel_matches_float64_causal_attention(dtype, heads, kv_heads, head_dim, two_threads, cpu_build):
    """The vector kernel itself (the op), whichever kernel prefill_attention would pick."""
    tokens = SPANS[-1][0] + SPANS[-1][1]
    q, k, v = fused_projection(tokens, heads, kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    _check_prefill(cpu_build.ops.prefill_attention(q, k, v, torch.tensor(SPANS), scale), q, k, v, scale)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (12, 2, 64), (4, 4, 256)])
@pytest.mark.parametrize("spans", [SPANS, [[0, 300]], [[0, 1], [1, 31], [32, 33]]], ids=["mixed", "long", "edges"])
def test_amx_prefill_kernel_matches_float64_causal_attention(heads, kv_heads, head_dim, spans, two_threads):
    """bf16 on AMX tiles (cpu_amx_attention.cpp), through prefill_attention, which picks it on
    this CPU: chunks shorter than a 16-query tile, across 32-key blocks, longer than L1."""
    build = cpu_library.load("avx512") if "avx512" in cpu_library.runnable_isas() else None
    if build is None or not cpu_attention.amx_prefill_runs(build, torch.bfloat16, head_dim):
        pytest.skip("needs AMX-BF16 (and the avx512 build)")
    tokens = spans[-1][0] + spans[-1][1]
    q, k, v = fused_projection(tokens, heads, kv_heads, head_dim, torch.bfloat16)
    scale = head_dim ** -0.5
    got = cpu_attention.prefill_attention(build, q, k, v, torch.tensor(spans), scale)
    _check_prefill(got, q, k, v, scale, spans)
    vector = build.ops.prefill_attention(q, k, v, torch.tensor(spans), scale)
    assert not torch.equal(got, vector)  # the AMX kernel ran, not the vector one


def test_amx_prefill_kernel_refuses_what_it_cannot_attend():
    build = cpu_library.load("avx512") if "avx512" in cpu_library.runnable_isas() else None
    if build is None or not cpu_attention.amx_prefill_runs(build, torch.bfloat16, 64):
        pytest.skip("needs AMX-BF16 (and the avx512 build)")
    q, k, v = fused_projection(10, 9, 3, 64, torch.float32)
    with pytest.raises(RuntimeError, match="q, k and v in bfloat16"):
        build.ops.amx_prefill_attention(q, k, v, torch.tensor([[0, 10]]), 0.125)
    q, k, v = fused_projection(10, 4, 2, 32, torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_dim 32 is not a multiple of 64"):
        build.ops.amx_prefill_attention(q, k, v, torch.tensor([[0, 10]]), 0.125)
    q, k, v = fused_projection(10, 9, 3, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"chunk 1 covers rows 6..12 of 10"):
        build.ops.amx_prefill_attention(q, k, v, torch.tensor([[0, 6], [6, 6]]), 0.125)


def _check_prefill(got, q, k, v, scale, spans=SPANS):
    dtype = q.dtype
    assert got.shape == q.shape and got.dtype == dtype
    for start, length in spans:
        rows = slice(start, start + length)
        want, _ = math_attention(q[rows], k[rows], v[rows], scale, torch.ones(length, length, dtype=torch.bool).tril())
        torch.testing.assert_close(got[rows].double(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_prefill_kernel_refuses_chunks_outside_the_batch(cpu_build):
    q, k, v = fused_projection(10, 9, 3, 64, torch.float32)
    with pytest.raises(RuntimeError, match=r"chunk 1 covers rows 6..12 of 10"):
        cpu_attention.prefill_attention(cpu_build, q, k, v, torch.tensor([[0, 6], [6, 6]]), 0.125)
    with pytest.raises(RuntimeError, match=r"chunks is \(n, 2\) int64"):
        cpu_attention.prefill_attention(cpu_build, q, k, v, torch.tensor([0, 6]), 0.125)


def test_a_step_with_fresh_and_prefixed_chunks_and_a_decode_matches_the_torch_backend(cpu_build):
    """Sequence A prefills 40 tokens, B 30; then A takes a 20-token chunk after its cached
    prefix (SDPA), C prefills 50 fresh (the kernel) and B decodes (the decode kernel)."""
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    g = torch.Generator().manual_seed(3)

    def rand(n, h):
        return torch.randn(n, h, head_dim, generator=g)

    caches = {name: tuple(torch.zeros(40, block, kv_heads, head_dim) for _ in range(2)) for name in ("cpu", "torch")}
    tables = [[1, 2, 3, 4], [10, 11], [20, 21, 22, 23]]
    steps = [([40, 30], [40, 30], tables[:2]), ([20, 1, 50], [60, 31, 50], tables)]
    for query_lens, seq_lens, step_tables in steps:
        n = sum(query_lens)
        q, k, v = rand(n, heads), rand(n, kv_heads), rand(n, kv_heads)
        fast_meta = build_cpu_metadata(query_lens, seq_lens, step_tables, block)
        fresh = [[start, length] for start, length, total in zip(fast_meta.query_start_loc, query_lens, seq_lens)
                 if length > 1 and length == total]
        assert fast_meta.fresh_chunks.tolist() == fresh
        fast = CpuBackend(cpu_build).attention(q, k, v, caches["cpu"], fast_meta, head_dim ** -0.5)
        want = paged_attention(q, k, v, caches["torch"], build_attention_metadata(query_lens, seq_lens, step_tables,
                                                                                 block), head_dim ** -0.5)
        torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kv_writes_what_index_copy_writes_and_refuses_slots_outside_the_cache(dtype, cpu_build):
    """The C++ KV store the cpu backend takes for caches of the rows' dtype: k and v as
    views of one fused projection, slots scattered over the blocks."""
    g = torch.Generator().manual_seed(0)
    tokens, kv_heads, head_dim = 37, 3, 64
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    _, k, v = qkv.split([9 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    caches = [torch.randn(10, 16, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    slots = torch.randperm(160, generator=g)[:tokens]
    cpu_build.ops.store_kv(k, v, caches[0], caches[1], slots)
    attention.store_kv(tuple(want), k, v, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    with pytest.raises(RuntimeError, match="slot 160 outside the cache's 160"):
        cpu_build.ops.store_kv(k[:1], v[:1], caches[0], caches[1], torch.tensor([160]))


def skipping_reference(q, k_cache, v_cache, tables, lens, scale, skips):
    """reference() with each query's keys at len - 1 - j left out for the bits j of its skip."""
    n, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.empty(n, heads, head_dim, dtype=torch.float64)
    for i in range(n):
        seen = [p for p in range(int(lens[i])) if not skips[i] >> (int(lens[i]) - 1 - p) & 1]
        keys = k_cache[tables[i]].flatten(0, 1)[seen].double().repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache[tables[i]].flatten(0, 1)[seen].double().repeat_interleave(heads // kv_heads, dim=1)
        weights = (torch.einsum("hd,khd->hk", q[i].double(), keys) * scale).softmax(-1)
        out[i] = torch.einsum("hk,khd->hd", weights, values)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 2, 24)])
@pytest.mark.parametrize("n,block_size", [(3, 16), (9, 4)])
def test_a_draft_trees_rows_skip_the_keys_beside_their_path(dtype, heads, kv_heads, head_dim, n, block_size,
                                                            two_threads, cpu_build):
    """Queries that skip some of their last keys (bit j of `skip`: the key j before their
    own; across block edges, on the vector paths and off them) against float64 attention
    without those keys; the torch backend's dense decode mask (attention.set_tree_skips)
    agrees; a query may not skip its own key."""
    lens = [40, 41, 17, 18, 33, 70, 5, 20, 21][:n]
    skips = [0b1011010, 0b10, 0b110, 0, 0b1111111111111110, 0b100, 0b10, 1 << 15, 0b11100][:n]
    q, k_cache, v_cache, tables, lens_t = make_case(n, heads, kv_heads, head_dim, block_size, lens, dtype)
    scale = head_dim ** -0.5
    skip_t = torch.tensor(skips, dtype=torch.long)
    got = cpu_attention.paged_decode_attention(cpu_build, q, k_cache, v_cache, tables, lens_t, scale, skip_t)
    want = skipping_reference(q, k_cache, v_cache, tables, lens_t, scale, skips)
    torch.testing.assert_close(got.double(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    plain = cpu_attention.paged_decode_attention(cpu_build, q, k_cache, v_cache, tables, lens_t, scale)
    assert not torch.allclose(plain, got)
    with pytest.raises(RuntimeError, match="query 0 skips its own key"):
        cpu_attention.paged_decode_attention(cpu_build, q, k_cache, v_cache, tables, lens_t, scale, skip_t | 1)


def test_tree_skips_reach_the_torch_and_cpu_backends_alike(cpu_build):
    """One step of decode rows, two of them a tree's (attention.set_tree_skips on each
    backend's metadata): the torch backend's masked SDPA and the C++ kernel agree, and a
    skip on a row that is not a decode row is refused."""
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(12, block_size, kv_heads, head_dim, generator=g) for _ in range(2))
    query_lens, seq_lens, tables = [1, 3], [7, 10], [[3, 5], [0, 2, 9]]
    q = torch.randn(4, heads, head_dim, generator=g)
    k, v = (torch.randn(4, kv_heads, head_dim, generator=g) for _ in range(2))
    row_skips = [0, 0, 0, 0b10]  # the chunk's rows 1 and 2 are siblings under its row 0
    torch_meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    attention.set_tree_skips(torch_meta, row_skips)
    cpu_meta = build_cpu_metadata(query_lens, seq_lens, tables, block_size)
    attention.set_tree_skips(cpu_meta, row_skips)
    assert cpu_meta.decode_skip.tolist() == [0, 0, 0, 0b10]
    want = paged_attention(q, k, v, (k_cache.clone(), v_cache.clone()), torch_meta, head_dim ** -0.5)
    got = CpuBackend(cpu_build).attention(q, k, v, (k_cache.clone(), v_cache.clone()), cpu_meta, head_dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    unmasked = paged_attention(q, k, v, (k_cache.clone(), v_cache.clone()),
                               build_attention_metadata(query_lens, seq_lens, tables, block_size), head_dim ** -0.5)
    assert torch.allclose(unmasked[:3], want[:3]) and not torch.allclose(unmasked[3], want[3])
    prefill = build_cpu_metadata([20], [20], [[0, 1, 2, 3, 4]], block_size)
    with pytest.raises(ValueError, match="not a decode row"):
        attention.set_tree_skips(prefill, [0] * 19 + [0b10])
