"""The Triton kernels compile for a real GPU (sm_90, Hopper: the H200), without one: triton
ships ptxas, so the whole pipeline down to a cubin runs on CPU. The interpreter executes
kernels as Python and misses what only the compiler rejects (a non-constexpr global, a dot
too small, mismatched types), so this checks every launch the wrappers make, with the
exact arguments they pass (bfloat16, the GPU's dtype)."""

from __future__ import annotations

import pytest
import torch

from meshserve.layers.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
         torch.int32: "i32", torch.bool: "i1"}


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


def signature(fn, args, kwargs) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of one recorded launch, as the JIT would build them."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    names = fn.arg_names
    sig, constexprs = {}, {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}.{name}: {type(value)}")
    for name, value in kwargs.items():
        sig[name] = "constexpr"
        constexprs[name] = value
    missing = [n for n in names if n not in sig]
    assert not missing, f"{fn.__name__}: arguments not passed: {missing}"
    return sig, constexprs, options


def record_launches(dtype: torch.dtype) -> list:
    """Every launch the wrappers make, with GPU tile sizes, on small CPU tensors (nothing runs)."""
    from meshserve.layers.kernels import decode_attention, prefill_attention, rms_norm, rotary

    calls: list = []
    modules = {decode_attention: ["_decode_kernel", "_merge_kernel"], prefill_attention: ["_prefill_kernel"],
               rms_norm: ["_rms_norm_kernel"], rotary: ["_rotary_kernel"]}
    saved = {(m, n): getattr(m, n) for m, names in modules.items() for n in names}
    try:
        for (m, n), fn in saved.items():
            setattr(m, n, Recorder(fn, calls))
        heads, kv_heads, dim = 32, 8, 128
        q = torch.zeros(6, heads, dim, dtype=dtype)
        cache = torch.zeros(20, 16, kv_heads, dim, dtype=dtype)
        tables, lens = torch.zeros(3, 16, dtype=torch.long), torch.tensor([5, 256, 30])
        rows = torch.tensor([0, 2, 5])
        for splits, lse in ((1, False), (1, True), (4, True)):
            decode_attention.paged_decode_attention(q, cache, cache, tables, lens, 0.1, max_len=256, rows=rows,
                                                    num_splits=splits, return_lse=lse, block_n=64)
        tiles = prefill_attention.tile_sizes(torch.device("cuda"), dim)
        as_t = lambda *x: torch.tensor(x)  # noqa: E731
        prefill_attention.prefill_attention(q, cache, cache, torch.empty_like(q), as_t(0, 3), as_t(3, 3), as_t(10, 3),
                                            0.1, max_query_len=3, block_tables=tables[:2], tiles=tiles)
        dense = torch.zeros(7, kv_heads, dim, dtype=dtype)
        out32 = torch.empty(q.shape, dtype=torch.float32)
        for pos in ((), (torch.arange(6), torch.arange(7))):
            prefill_attention.prefill_attention(q, dense, dense, out32, as_t(0), as_t(6), as_t(7), 0.1, max_query_len=6,
                                                causal=False, return_lse=True, tiles=tiles,
                                                **dict(zip(("q_pos", "k_pos"), pos)))
        x = torch.zeros(4, 4096, dtype=dtype)
        rms_norm.rms_norm(x, x[0], 1e-5)
        rms_norm.rms_norm(x, x[0], 1e-5, x)
        qkv = torch.zeros(4, (heads + 2 * kv_heads) * dim, dtype=dtype)
        qv, kv, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        cos = torch.zeros(4, 1, dim, dtype=dtype)
        rotary.rotary_(qv.view(4, heads, dim), kv.view(4, kv_heads, dim), cos, cos)
    finally:
        for (m, n), fn in saved.items():
            setattr(m, n, fn)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # the GPU dtype; float16/float32 take 20 s/70 s more here
def test_every_launch_compiles_for_sm90(dtype):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    calls = record_launches(dtype)
    assert {fn.__name__ for fn, _, _ in calls} == {"_decode_kernel", "_merge_kernel", "_prefill_kernel",
                                                   "_rms_norm_kernel", "_rotary_kernel"}
    seen = set()
    for fn, args, kwargs in calls:
        sig, constexprs, options = signature(fn, args, dict(kwargs))
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(constexprs.items())))
        if key in seen:
            continue
        seen.add(key)
        kernel = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
        assert kernel.asm["cubin"], fn.__name__
        # Hopper has 228 KiB of shared memory per SM (227 usable by one block)
        assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, kernel.metadata.shared)
