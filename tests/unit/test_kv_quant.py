"""The int8 KV cache (cache.dtype=int8, meshserve.layers.kv_quant): its rows round-trip
within half a code of their absmax / 127; the C++ quantizer matches the torch one; the C++
decode kernel over an int8 cache matches the same kernel over the dequantized cache (and
float64 attention); the torch and cpu backends' paged attention over an int8 cache matches
dense attention over what the cache holds; the memory plan and the config's refusals; and
the engine serves with it, compiled as eager."""

from __future__ import annotations

import pytest
import torch

from meshserve.comm.messages import SamplingParams
from meshserve.configs import ConfigError, load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine.offline import generate
from meshserve.layers import kv_quant
from meshserve.layers.backend import select_backend
from meshserve.layers.kernels import cpu_attention, cpu_library
from support.engines import make_engine
from support.kernel_cases import OUT_TOL, gather, math_attention

native = pytest.mark.skipif(cpu_library.load() is None, reason="no C++ compiler for the cpu backend's kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_round_trip_within_half_a_code(dtype):
    x = (torch.randn(7, 3, 64) * torch.logspace(-3, 2, 7)[:, None, None]).to(dtype)
    x[2, 1] = 0  # an all-zero row: scale stays finite, codes 0
    packed = kv_quant.quantize(x)
    assert packed.shape == (7, 3, 68) and packed.dtype == torch.int8
    back = kv_quant.dequantize(packed, torch.float32)
    assert back.shape == x.shape and torch.isfinite(back).all()
    step = x.float().abs().amax(-1, keepdim=True) / 127
    assert ((back - x.float()).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (back[2, 1] == 0).all()
    assert kv_quant.row_length(64) == 68


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(5, 3, 64), (1, 1, 128), (33, 2, 24), (4, 16, 8, 64)])
def test_cpp_quantizer_matches_torch(dtype, shape, cpu_build):
    x = torch.randn(shape).to(dtype)
    got, want = cpu_build.ops.quantize_kv_int8(x), kv_quant.quantize(x)
    assert got.shape == want.shape and got.dtype == torch.int8
    assert (got[..., :-4].int() - want[..., :-4].int()).abs().max() <= 1  # a tie may round either way
    torch.testing.assert_close(got[..., -4:].contiguous().view(torch.float32),
                               want[..., -4:].contiguous().view(torch.float32), rtol=1e-6, atol=0)


def random_int8_case(n, heads, kv_heads, head_dim, block_size, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-length // block_size) for length in lens) + 1
    num_blocks = n * width + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (kv_quant.quantize(torch.randn(shape, generator=g) * 3) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=g)[: n * width].view(n, width)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.long)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 2, 24)])
@pytest.mark.parametrize("n,block_size,lens", [(1, 16, [1]), (3, 16, [16, 33, 200]), (2, 32, [5, 70]),
                                               (12, 8, [1, 2, 7, 8, 9, 15, 16, 17, 40, 63, 64, 100])])
def test_decode_kernel_over_int8_matches_the_dequantized_cache(dtype, heads, kv_heads, head_dim, n, block_size, lens,
                                                               cpu_build):
    q, k8, v8, tables, lens_t = random_int8_case(n, heads, kv_heads, head_dim, block_size, lens, dtype)
    scale = head_dim ** -0.5
    got = cpu_attention.paged_decode_attention(cpu_build, q, k8, v8, tables, lens_t, scale)
    assert got.shape == q.shape and got.dtype == dtype
    k, v = kv_quant.dequantize(k8, torch.float32), kv_quant.dequantize(v8, torch.float32)
    want = torch.cat([math_attention(q[i:i + 1], gather(k, tables[i].tolist(), length),
                                     gather(v, tables[i].tolist(), length), scale,
                                     torch.ones(1, length, dtype=torch.bool))[0]
                      for i, length in enumerate(lens)])
    torch.testing.assert_close(got.double(), want, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(got, cpu_attention.paged_decode_attention(cpu_build, q, k, v, tables, lens_t, scale),
                                   atol=1e-5, rtol=1e-5)


@native
def test_decode_kernel_refuses_an_int8_cache_of_the_wrong_row_length():
    q, k8, v8, tables, lens = random_int8_case(2, 9, 3, 64, 16, [5, 20], torch.float32)
    with pytest.raises(RuntimeError, match=r"q.s head_dim \(64\) long, plus 4 bytes of scale for int8 \(got 64\)"):
        cpu_attention.paged_decode_attention(cpu_library.load(), q, k8[..., :64].contiguous(),
                                             v8[..., :64].contiguous(), tables, lens, 0.125)


HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 8


def dense_causal(q, k, v, scale):
    """(len, heads, dim) float64 softmax attention, causal, GQA by repeating KV heads."""
    k = k.double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(torch.ones(len(q), len(k), dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def cached(cache, table, length):
    """What an int8 cache holds for one sequence, dequantized: (length, kv_heads, head_dim)."""
    return kv_quant.dequantize(cache[torch.tensor(table)].flatten(0, 1)[:length], torch.float32)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=native)])
def test_paged_attention_over_an_int8_cache_matches_dense_attention_over_its_contents(backend):
    """Step 1 prefills A and B (attending to their unquantized K/V); step 2 prefills a
    second chunk of A over its cached prefix and decodes one token of B, both reading the
    int8 cache (the chunk's own rows too, as stored)."""
    impl = select_backend(backend, library=cpu_library.load())
    torch.manual_seed(0)
    first, second, other = 70, 21, 30
    total_a, total_b = first + second, other + 1
    qa, ka, va = (torch.randn(total_a, h, HEAD_DIM) * 2 for h in (HEADS, KV_HEADS, KV_HEADS))
    qb, kb, vb = (torch.randn(total_b, h, HEAD_DIM) * 2 for h in (HEADS, KV_HEADS, KV_HEADS))
    cache = tuple(torch.zeros(64, BLOCK, KV_HEADS, kv_quant.row_length(HEAD_DIM), dtype=torch.int8) for _ in range(2))
    table_a, table_b = list(range(1, 1 + -(-total_a // BLOCK))), list(range(40, 40 + -(-total_b // BLOCK)))
    scale = HEAD_DIM ** -0.5

    meta = impl.build_metadata([first, other], [first, other], [table_a, table_b], BLOCK)
    out1 = impl.attention(torch.cat([qa[:first], qb[:other]]), torch.cat([ka[:first], kb[:other]]),
                  torch.cat([va[:first], vb[:other]]), cache, meta, scale)
    meta = impl.build_metadata([second, 1], [total_a, total_b], [table_a, table_b], BLOCK)
    out2 = impl.attention(torch.cat([qa[first:], qb[other:]]), torch.cat([ka[first:], kb[other:]]),
                  torch.cat([va[first:], vb[other:]]), cache, meta, scale)

    stored_a = cached(cache[0], table_a, total_a), cached(cache[1], table_a, total_a)
    stored_b = cached(cache[0], table_b, total_b), cached(cache[1], table_b, total_b)
    # what was stored is the new rows, quantized
    assert (stored_a[0] - ka).abs().max() <= ka.abs().max() / 127
    torch.testing.assert_close(out1[:first].double(), dense_causal(qa, ka, va, scale)[:first], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out1[first:].double(), dense_causal(qb, kb, vb, scale)[:other], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2[:second].double(), dense_causal(qa, *stored_a, scale)[first:], atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(out2[second:].double(), dense_causal(qb, *stored_b, scale)[other:], atol=1e-5,
                               rtol=1e-5)
    # and the quantization moved the answer, but not far: a few hundredths of the values' range
    exact = dense_causal(qa, ka, va, scale)[first:]
    assert 0 < (out2[:second].double() - exact).abs().max() < 0.05 * va.abs().max()


def test_memory_plan_counts_codes_and_scales(tiny_checkpoints):
    settings = [f"model.path={tiny_checkpoints['llama']}", "model.dtype=bfloat16", "cache.memory=8MiB"]
    auto, int8 = (load_config(None, [*settings, f"cache.dtype={d}"]) for d in ("auto", "int8"))
    info = check_config(auto)
    check_config(int8)
    a, b = plan_memory(auto, info), plan_memory(int8, info)
    layers, kv_heads, head_dim = info.num_hidden_layers, info.num_key_value_heads, info.head_dim
    assert a.kv_bytes_per_token == 2 * layers * kv_heads * head_dim * 2
    assert b.kv_bytes_per_token == 2 * layers * kv_heads * (head_dim + 4) and b.kv_dtype == "int8"
    assert b.num_blocks > a.num_blocks


@pytest.mark.parametrize("overrides,message", [
    (["device.type=cuda"], r"cache.dtype=int8 is read by the CPU kernels; device.type=cuda with device.kernels=auto"),
    (["device.kernels=triton"], r"device.kernels=triton needs cache.dtype=auto"),
    (["parallel.context=2"], r"cache.dtype=int8 with parallel.context=2: context parallelism needs cache.dtype=auto"),
])
def test_config_refuses_int8_cache_where_it_is_not_read(tiny_checkpoints, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(None, [f"model.path={tiny_checkpoints['llama']}", "cache.dtype=int8", *overrides]))


PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7], list(range(1000, 1023))]
NEW_TOKENS = [12, 20, 30, 16]


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["torch", pytest.param("cpu", marks=native)])
def test_engine_with_int8_cache_compiled_matches_eager_and_stays_near_the_full_cache(tiny_checkpoints, kernels):
    path = tiny_checkpoints["llama-untied"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0) for n in NEW_TOKENS]
    settings = ["model.dtype=float32", f"device.kernels={kernels}", "cache.block_size=4"]
    full = generate(make_engine(path, *settings), PROMPTS, params)
    eager = generate(make_engine(path, *settings, "cache.dtype=int8"), PROMPTS, params)
    engine = make_engine(path, *settings, "cache.dtype=int8", "device.compile=true")
    compiled = generate(engine, PROMPTS, params)
    assert engine.executor.runner.kv_caches[0][0].dtype == torch.int8
    assert engine.executor.runner.decode.compiled.steps > 0 and engine.executor.runner.decode.compiled.eager_steps == 0
    assert [c.token_ids for c in compiled] == [c.token_ids for c in eager]
    for a, b in zip(compiled, eager):
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-3
    # int8 rows move each chosen token's logprob a little from the full-precision cache's,
    # where both runs chose the same tokens so far
    moved = []
    for a, b in zip(eager, full):
        for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            if a.token_ids[i] != b.token_ids[i]:
                break
            moved.append(abs(x.logprob - y.logprob))
    assert len(moved) >= len(PROMPTS) and 0 < max(moved) < 0.1
