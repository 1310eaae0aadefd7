"""The cpu backend's one-pass RMSNorm, silu-and-mul and rotary (layers/kernels/cpu_norm_act.cpp)
against the torch references they replace in eager steps: float32, bf16 and float16, widths
on and off the 16-wide vector path, with and without the residual; and the backend keeping
the torch ops where it must (inside torch.compile, odd layouts). The sampler's argmax
against torch's, ties included."""

from __future__ import annotations

import pytest
import torch

from meshserve.layers.activation import silu_and_mul
from meshserve.layers.cpu_backend import CpuBackend
from meshserve.layers.kernels import cpu_library
from meshserve.layers.norm import rms_norm
from meshserve.layers.rotary import RotaryEmbedding
from meshserve.layers.sampler import argmax

pytestmark = pytest.mark.skipif(cpu_library.load() is None, reason="no C++ compiler for the CPU kernels")

# one unit in the last place of the output dtype, at the values' scale (~1-4 here)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,cols", [(1, 576), (33, 100), (300, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_reference(dtype, rows, cols, with_residual, cpu_build):
    torch.manual_seed(0)
    x = (torch.randn(rows, cols) * 2).to(dtype)
    weight = (torch.rand(cols) + 0.5).to(dtype)
    residual = torch.randn(rows, cols).to(dtype) if with_residual else None
    want = rms_norm(x, weight, 1e-5, residual)
    got = CpuBackend(cpu_build).rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # one add, one rounding: the same
        got, want = got[0], want[0]
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,half", [(1, 1536), (17, 40), (64, 7)])
def test_silu_and_mul_matches_the_torch_reference(dtype, rows, half, cpu_build):
    torch.manual_seed(0)
    x = (torch.randn(rows, 2 * half) * 4).to(dtype)
    x[0, :3] = torch.tensor([-90.0, 0.0, 90.0])  # exp's clamps and zero
    want = silu_and_mul(x.double())
    got = CpuBackend(cpu_build).silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (rows, half)
    torch.testing.assert_close(got.double(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (7, 4, 4, 6), (33, 2, 1, 128)])
def test_rotary_matches_the_torch_reference_on_views_of_the_qkv_product(dtype, tokens, heads, kv_heads, head_dim,
                                                                       cpu_build):
    """q and k as the attention takes them: strided views of one qkv row per token; each
    product and the sum rounded to the dtype as torch's ops round them."""
    torch.manual_seed(0)
    rope_table = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,))
    rope = rope_table.lookup(positions, dtype)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 3).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    want_q, want_k = RotaryEmbedding.apply(rope, q, k)
    got_q, got_k = CpuBackend(cpu_build).rotary(rope, q, k)
    assert got_q.is_contiguous() and got_q.dtype == dtype and got_k.shape == k.shape
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 0.0, torch.float16: 0.0}[dtype]
    torch.testing.assert_close(got_q, want_q, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(got_k, want_k, atol=tolerance, rtol=tolerance)


def test_the_backend_keeps_torch_ops_inside_compile_and_for_odd_layouts(cpu_build):
    torch.manual_seed(0)
    x, weight = torch.randn(8, 64), torch.rand(64) + 0.5
    backend = CpuBackend(cpu_build)
    compiled = torch.compile(lambda x: backend.silu_and_mul(backend.rms_norm(x, weight, 1e-5)), fullgraph=True)
    torch.testing.assert_close(compiled(x), silu_and_mul(rms_norm(x, weight, 1e-5)), atol=1e-5, rtol=1e-5)
    strided = torch.randn(8, 128)[:, ::2]
    torch.testing.assert_close(backend.rms_norm(strided, weight, 1e-5), rms_norm(strided, weight, 1e-5))
    three_d = torch.randn(2, 3, 64)
    torch.testing.assert_close(backend.silu_and_mul(three_d), silu_and_mul(three_d))


def test_bad_shapes_are_refused(cpu_build):
    with pytest.raises(RuntimeError, match="one weight per column"):
        cpu_build.ops.rms_norm(torch.randn(4, 64), torch.ones(32), 1e-5, None)
    with pytest.raises(RuntimeError, match="the residual must be contiguous and of x's shape and dtype"):
        cpu_build.ops.rms_norm(torch.randn(4, 64), torch.ones(64), 1e-5, torch.randn(4, 64).double())
    with pytest.raises(RuntimeError, match=r"silu_and_mul takes contiguous \(rows, 2n\)"):
        cpu_build.ops.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="rotary takes q and k of"):
        cpu_build.ops.rotary(torch.randn(2, 3, 5), torch.randn(2, 1, 5), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous"):
        cpu_build.ops.rotary(torch.randn(2, 3, 4), torch.randn(2, 1, 4), torch.randn(2, 4), torch.randn(2, 4).double())


@pytest.mark.parametrize("rows,n", [(32, 49152), (3, 7), (5, 16), (4, 33), (1, 1)])
def test_argmax_matches_torch(rows, n, cpu_build):
    torch.manual_seed(0)
    x = torch.randn(rows, n)
    assert torch.equal(argmax(x, cpu_build), x.argmax(-1))


def test_argmax_takes_the_first_of_ties_and_skips_minus_infinity(cpu_build):
    x = torch.zeros(4, 100)
    x[:, 5] = x[:, 50] = 1  # a tie in different vector lanes and blocks
    x[1, 99] = 2  # the maximum in the scalar tail
    x[2] = float("-inf")
    x[2, 3] = -1
    x[3, 21] = 1  # a tie in the same lane as column 5, one block later
    assert argmax(x, cpu_build).tolist() == [5, 99, 3, 5]
    assert argmax(torch.full((2, 40), 3.0), cpu_build).tolist() == [0, 0]
    assert torch.equal(argmax(x.double(), cpu_build), x.argmax(-1))  # other dtypes: torch's own
