"""Checks of the Triton kernels against references, shared by the interpreter tests (CPU,
TRITON_INTERPRET=1), the GPU tests and scripts/gpu_check.py.

Each check returns a list of (what, error, tolerance) rows; a check passes when every
error is within its tolerance. The references are float64 math on the same (rounded)
inputs, and meshserve's torch backend. Nothing here imports triton at module level: a
process must set TRITON_INTERPRET before the first kernel module is imported, so the
interpreter runs happen in a subprocess (`python -m support.kernel_cases ...`, which sets
it itself for --device cpu) and print JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OUT_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
LSE_TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
NORM_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

Row = tuple[str, float, float]


# ---------------------------------------------------------------- inputs and references


def paged_step(query_lens: list[int], seq_lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: str, seed: int):
    """Random q/k/v for a step's new tokens and a random paged cache. Block tables have
    holes: block ids are shuffled and every other block of the cache belongs to no one.
    Returns (q, k, v, k_cache, v_cache, block_tables)."""
    g = torch.Generator().manual_seed(seed)
    needed = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = 2 * needed + 1
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(ids[used:used + 2 * n:2])  # skip one id after each: holes between a sequence's blocks
        used += 2 * n
    n_tokens = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return (rand(n_tokens, heads, head_dim), rand(n_tokens, kv_heads, head_dim), rand(n_tokens, kv_heads, head_dim),
            rand(num_blocks, block_size, kv_heads, head_dim), rand(num_blocks, block_size, kv_heads, head_dim), tables)


def gather(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """(length, kv_heads, head_dim) of one sequence from a paged cache."""
    idx = torch.tensor(table, device=cache.device)
    return cache.index_select(0, idx).flatten(0, 1)[:length]


def math_attention(q, keys, values, scale, visible) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference. q (T, H, D), keys/values (L, Hkv, D), visible (T, L) bool ->
    out (T, H, D), lse (T, H) (-inf and out 0 where a row sees nothing)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (H, T)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("htl,lhd->thd", p, v), lse.transpose(0, 1)


def causal_reference(q, k_cache, v_cache, query_lens, seq_lens, tables, scale):
    """out, lse of a whole step (the cache already holds the new tokens)."""
    outs, lses, row = [], [], 0
    for ql, sl, table in zip(query_lens, seq_lens, tables):
        keys, values = gather(k_cache, table, sl), gather(v_cache, table, sl)
        visible = torch.arange(sl, device=q.device)[None, :] <= (torch.arange(ql, device=q.device)[:, None] + sl - ql)
        o, l = math_attention(q[row:row + ql], keys, values, scale, visible)
        outs.append(o)
        lses.append(l)
        row += ql
    return torch.cat(outs), torch.cat(lses)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; matching infinities count as equal."""
    a, b = a.double(), b.double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    d = (a - b).abs().masked_fill(both_inf, 0.0)
    return float(d.max()) if d.numel() else 0.0


def store(k_cache, v_cache, k, v, query_lens, seq_lens, tables, block_size):
    """Write the step's new K/V where they belong (as the backends do), for references."""
    row = 0
    for ql, sl, table in zip(query_lens, seq_lens, tables):
        for i, pos in enumerate(range(sl - ql, sl)):
            b, o = table[pos // block_size], pos % block_size
            k_cache[b, o], v_cache[b, o] = k[row + i], v[row + i]
        row += ql


# ---------------------------------------------------------------- checks

STEP = dict(query_lens=[1, 7, 5, 1, 19, 1], seq_lens=[10, 7, 11, 1, 40, 33])
"""A mixed step: decodes (short, one token, long), a prefill without prefix, chunks after
a cached prefix of 6 and of 21 tokens."""


def check_attention_step(dtype, device, block_size: int, heads: int, kv_heads: int, head_dim: int = 16,
                         seed: int = 0) -> list[Row]:
    """TritonBackend.attention on a mixed step vs float64 math and vs the torch backend;
    the KV cache it stores vs the torch backend's."""
    from meshserve.layers.backend import TorchBackend
    from meshserve.layers.triton_backend import TritonBackend

    ql, sl = STEP["query_lens"], STEP["seq_lens"]
    q, k, v, kc, vc, tables = paged_step(ql, sl, block_size, heads, kv_heads, head_dim, dtype, device, seed)
    scale = head_dim ** -0.5
    triton_cache = (kc.clone(), vc.clone())
    backend = TritonBackend()
    out = backend.attention(q, k, v, triton_cache, backend.build_metadata(ql, sl, tables, block_size, device), scale)
    ref_k, ref_v = kc.clone(), vc.clone()
    store(ref_k, ref_v, k, v, ql, sl, tables, block_size)
    want, _ = causal_reference(q, ref_k, ref_v, ql, sl, tables, scale)
    torch_cache = (kc.float().clone(), vc.float().clone())  # the torch backend as a second oracle, in float32
    torch_backend = TorchBackend()
    torch_out = torch_backend.attention(q.float(), k.float(), v.float(), torch_cache,
                                        torch_backend.build_metadata(ql, sl, tables, block_size, device), scale)
    return [("out vs math", err(out, want), OUT_TOL[dtype]),
            ("out vs torch backend", err(out, torch_out), OUT_TOL[dtype]),
            ("k cache", err(triton_cache[0], ref_k), 0.0), ("v cache", err(triton_cache[1], ref_v), 0.0)]


def check_prefill_lse(dtype, device, block_size: int, heads: int, kv_heads: int, head_dim: int = 16,
                      seed: int = 1) -> list[Row]:
    """prefill_attention's out and LSE (varlen, chunks after a cached prefix) vs math."""
    from meshserve.layers.kernels.prefill_attention import prefill_attention

    ql, sl = [7, 5, 19, 2], [7, 11, 40, 3]
    q, _, _, kc, vc, tables = paged_step(ql, sl, block_size, heads, kv_heads, head_dim, dtype, device, seed)
    scale = head_dim ** -0.5
    starts = [sum(ql[:i]) for i in range(len(ql))]
    width = max(len(t) for t in tables)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    out = torch.empty_like(q)
    lse = prefill_attention(q, kc, vc, out, as_tensor(starts), as_tensor(ql), as_tensor(sl), scale,
                            max_query_len=max(ql), block_tables=as_tensor([t + [0] * (width - len(t)) for t in tables]),
                            return_lse=True)
    want, want_lse = causal_reference(q, kc, vc, ql, sl, tables, scale)
    return [("out", err(out, want), OUT_TOL[dtype]), ("lse", err(lse, want_lse), LSE_TOL[dtype])]


TREE_SKIPS = [0, 0b10110, 0, 0b100, 0b1010]
"""Keys each of check_decode's queries skips with `tree`: bit j, the key at position len - 1 - j."""


def check_decode(dtype, device, block_size: int, heads: int, kv_heads: int, num_splits: int, head_dim: int = 16,
                 seed: int = 2, tree: bool = False) -> list[Row]:
    """paged_decode_attention with LSE over ragged contexts (one of them empty), split into
    `num_splits` slices, vs math; with `tree`, queries skipping some of their last keys (a
    draft tree's rows)."""
    from meshserve.layers.kernels.decode_attention import paged_decode_attention

    lens = [1, 37, 0, 9, 64]
    q, _, _, kc, vc, tables = paged_step([1] * len(lens), [max(n, 1) for n in lens], block_size, heads, kv_heads,
                                         head_dim, dtype, device, seed)
    width = max(len(t) for t in tables)
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
    out, lse = paged_decode_attention(q, kc, vc, tab, torch.tensor(lens, device=device), head_dim ** -0.5,
                                      max_len=max(lens), num_splits=num_splits, return_lse=True, block_n=16,
                                      skip=torch.tensor(TREE_SKIPS, device=device) if tree else None)
    want, want_lse = [], []
    for i, (n, table) in enumerate(zip(lens, tables)):
        visible = torch.ones(1, n, dtype=torch.bool, device=device)
        for j in range(n if tree else 0):
            if TREE_SKIPS[i] >> j & 1:
                visible[0, n - 1 - j] = False
        o, l = math_attention(q[i:i + 1], gather(kc, table, n), gather(vc, table, n), head_dim ** -0.5, visible)
        want.append(o)
        want_lse.append(l)
    return [("out", err(out, torch.cat(want)), OUT_TOL[dtype]), ("lse", err(lse, torch.cat(want_lse)), LSE_TOL[dtype])]


def check_context_parallel_parts(dtype, device, heads: int = 6, kv_heads: int = 2, head_dim: int = 16,
                                 seed: int = 3) -> list[Row]:
    """The two LSE attentions context parallelism asks of a backend: decode over this
    rank's share (a rank that holds nothing included) and ring tiles with positions."""
    from meshserve.parallel.context_attention import CPSeqStep, build_cp_metadata
    from meshserve.layers.triton_backend import TritonBackend

    backend, block_size, scale = TritonBackend(), 8, head_dim ** -0.5
    held = [0, 5, 19]
    _, _, _, kc, vc, tables = paged_step([1] * 3, [max(n, 1) for n in held], block_size, heads, kv_heads, head_dim,
                                         dtype, device, seed)
    steps = [CPSeqStep(i, [40], False, t, [], [n, 3], [], []) for i, (n, t) in enumerate(zip(held, tables))]
    meta = build_cp_metadata(steps, 0, block_size, dtype, device)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, heads, head_dim, generator=g).to(dtype).to(device)
    out, lse = backend.cp_decode_lse(q, kc, vc, meta, scale)
    rows = []
    want = [math_attention(q[i:i + 1], gather(kc, t, n), gather(vc, t, n), scale,
                           torch.ones(1, n, dtype=torch.bool, device=device))
            for i, (n, t) in enumerate(zip(held, tables))]
    rows += [("decode out", err(out, torch.cat([w[0] for w in want])), OUT_TOL[dtype]),
             ("decode lse", err(lse, torch.cat([w[1] for w in want])), LSE_TOL[dtype])]
    q_pos = torch.tensor([3, 4, 9, 10, 11, 30], device=device)
    k_pos = torch.tensor([0, 1, 5, 6, 10, 12, 13, 31], device=device)
    qt = torch.randn(6, heads, head_dim, generator=g).to(dtype).to(device)
    kt, vt = (torch.randn(8, kv_heads, head_dim, generator=g).to(dtype).to(device) for _ in range(2))
    for what, args, visible in (("ring tile, all keys", (), torch.ones(6, 8, dtype=torch.bool, device=device)),
                                ("ring tile, positions", (q_pos, k_pos), q_pos[:, None] >= k_pos[None, :])):
        o, l = backend.attention_lse(qt, kt, vt, scale, *args)
        wo, wl = math_attention(qt, kt, vt, scale, visible)
        rows += [(f"{what} out", err(o, wo), OUT_TOL[dtype]), (f"{what} lse", err(l, wl), LSE_TOL[dtype])]
    # a tile where the first query sees no key: out 0, lse -inf
    o, l = backend.attention_lse(qt[:3], kt[:3], vt[:3], scale, torch.tensor([0, 1, 2], device=device),
                                 torch.tensor([1, 2, 5], device=device))
    wo, wl = math_attention(qt[:3], kt[:3], vt[:3], scale, torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 0]],
                                                                         dtype=torch.bool, device=device))
    rows += [("ring tile, row sees nothing: out", err(o, wo), OUT_TOL[dtype]),
             ("ring tile, row sees nothing: lse", err(l, wl), LSE_TOL[dtype])]
    return rows


def check_cp_attention(dtype, device, block_size: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                       seed: int = 6) -> list[Row]:
    """cp_attention (one rank) with the Triton backend: a split chunk (ring), a chunk after a
    cached prefix (merge) and a decode, through the same code as context parallelism,
    vs float64 math."""
    from meshserve.comm.groups import AxisGroup
    from meshserve.parallel.context_attention import CPSeqStep, build_cp_metadata, cp_attention
    from meshserve.layers.triton_backend import TritonBackend

    ql, sl = [12, 3, 1], [12, 8, 10]
    q, k, v, kc, vc, tables = paged_step(ql, sl, block_size, heads, kv_heads, head_dim, dtype, device, seed)
    steps = [CPSeqStep(0, list(range(12)), True, tables[0], list(range(12)), [12], list(range(12)), list(range(12))),
             CPSeqStep(12, [5, 6, 7], False, tables[1], list(range(8)), [8], [12, 13, 14], [5, 6, 7]),
             CPSeqStep(15, [9], False, tables[2], list(range(10)), [10], [15], [9])]
    meta = build_cp_metadata(steps, 0, block_size, dtype, device)
    scale = head_dim ** -0.5
    cache = (kc.clone(), vc.clone())
    out = cp_attention(q, k, v, cache, meta, AxisGroup.single("cp"), scale, TritonBackend())
    store(kc, vc, k, v, ql, sl, tables, block_size)
    want, _ = causal_reference(q, kc, vc, ql, sl, tables, scale)
    return [("out", err(out, want), OUT_TOL[dtype]), ("k cache", err(cache[0], kc), 0.0)]


def check_rms_norm(dtype, device, hidden: int, seed: int = 4) -> list[Row]:
    """Fused RMSNorm (+ residual) vs the torch reference (same rounding steps)."""
    from meshserve.layers.kernels.rms_norm import rms_norm as fused
    from meshserve.layers.norm import rms_norm

    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(7, hidden, generator=g).to(dtype).to(device) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    y, res = fused(x, w, 1e-5, r)
    want_y, want_res = rms_norm(x, w, 1e-5, r)
    return [("norm", err(fused(x, w, 1e-5), rms_norm(x, w, 1e-5)), NORM_TOL[dtype]),
            ("norm + residual", err(y, want_y), NORM_TOL[dtype]), ("residual", err(res, want_res), NORM_TOL[dtype])]


def check_rotary(dtype, device, heads: int, kv_heads: int, head_dim: int, seed: int = 5) -> list[Row]:
    """In-place rotary on strided q/k views (slices of one QKV output) vs the torch
    reference in float32; v, between them, untouched."""
    from meshserve.layers.kernels.rotary import rotary_
    from meshserve.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    n = 9
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    before = qkv.clone()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 512, 10000.0).to(device)
    positions = torch.tensor([0, 1, 2, 3, 100, 101, 7, 8, 511], device=device)
    want_q, want_k = RotaryEmbedding.apply(rope.lookup(positions, torch.float32), q.float(), k.float())
    out_q, out_k = rotary_(q, k, *rope.lookup(positions, dtype))
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    return [("q", err(out_q, want_q), tol), ("k", err(out_k, want_k), tol),
            ("in place", float(out_q.data_ptr() != q.data_ptr()), 0.0),
            ("v untouched", err(v, before[:, (heads + kv_heads) * head_dim:]), 0.0)]


def check_rotary_store(dtype, device, block_size: int, heads: int, kv_heads: int, head_dim: int = 16,
                       seed: int = 6) -> list[Row]:
    """TritonBackend.rotary_attention (rotary and the cache writes in one kernel) on a mixed
    step, q/k/v slices of one QKV output: the same cache and output as rotary_ then attention
    (the same rounding steps), and the output vs float64 math on the rotated inputs."""
    from meshserve.layers.kernels.rotary import rotary_
    from meshserve.layers.rotary import RotaryEmbedding
    from meshserve.layers.triton_backend import TritonBackend

    ql, sl = STEP["query_lens"], STEP["seq_lens"]
    q, k, v, kc, vc, tables = paged_step(ql, sl, block_size, heads, kv_heads, head_dim, dtype, device, seed)
    n = q.shape[0]
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q, k, v = (x.view(n, -1, head_dim) for x in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                           kv_heads * head_dim], dim=-1))
    positions = torch.tensor([p for q_len, s_len in zip(ql, sl) for p in range(s_len - q_len, s_len)], device=device)
    rope = RotaryEmbedding(head_dim, 512, 10000.0).to(device).lookup(positions, dtype)
    backend, scale = TritonBackend(), head_dim ** -0.5
    meta = backend.build_metadata(ql, sl, tables, block_size, device)
    fused_cache = (kc.clone(), vc.clone())
    k_before = k.clone()
    fused_q = q.clone()
    out = backend.rotary_attention(rope, fused_q, k, v, fused_cache, meta, scale)
    plain_cache = (kc.clone(), vc.clone())
    plain_q, plain_k = rotary_(q.clone(), k.clone(), *rope)
    want = backend.attention(plain_q, plain_k, v, plain_cache, meta, scale)
    ref_k, ref_v = kc.clone(), vc.clone()
    store(ref_k, ref_v, plain_k, v, ql, sl, tables, block_size)
    math_out, _ = causal_reference(plain_q, ref_k, ref_v, ql, sl, tables, scale)
    return [("k cache vs rotary_ + store", err(fused_cache[0], plain_cache[0]), 0.0),
            ("v cache", err(fused_cache[1], plain_cache[1]), 0.0),
            ("q rotated in place", err(fused_q, plain_q), 0.0), ("k untouched", err(k, k_before), 0.0),
            ("out vs unfused", err(out, want), 0.0), ("out vs math", err(out, math_out), OUT_TOL[dtype])]


KERNEL_CHECKS = {
    # name: (function, keyword arguments)
    "step bs4 gqa2": (check_attention_step, dict(block_size=4, heads=4, kv_heads=2)),
    "step bs16 gqa4": (check_attention_step, dict(block_size=16, heads=8, kv_heads=2)),
    "step bs1 mha": (check_attention_step, dict(block_size=1, heads=2, kv_heads=2)),
    "prefill lse bs8 gqa3 d32": (check_prefill_lse, dict(block_size=8, heads=6, kv_heads=2, head_dim=32)),
    "prefill lse bs64 mqa": (check_prefill_lse, dict(block_size=64, heads=4, kv_heads=1)),
    "decode bs4 gqa2": (check_decode, dict(block_size=4, heads=4, kv_heads=2, num_splits=1)),
    "decode bs16 mqa8 split3": (check_decode, dict(block_size=16, heads=8, kv_heads=1, num_splits=3)),
    "decode bs2 mha split2 d24": (check_decode, dict(block_size=2, heads=3, kv_heads=3, num_splits=2, head_dim=24)),
    "decode tree bs4 gqa2 split2": (check_decode, dict(block_size=4, heads=4, kv_heads=2, num_splits=2, tree=True)),
    "context parallel parts": (check_context_parallel_parts, {}),
    "context parallel step": (check_cp_attention, {}),
    "rms_norm 64": (check_rms_norm, dict(hidden=64)),
    "rms_norm 100": (check_rms_norm, dict(hidden=100)),
    "rotary gqa2 d16": (check_rotary, dict(heads=4, kv_heads=2, head_dim=16)),
    "rotary h3 d64": (check_rotary, dict(heads=3, kv_heads=1, head_dim=64)),
    "rotary + store bs4 gqa2": (check_rotary_store, dict(block_size=4, heads=4, kv_heads=2)),
    "rotary + store bs16 h3 d64": (check_rotary_store, dict(block_size=16, heads=3, kv_heads=1, head_dim=64)),
}


def run_kernel_checks(dtypes: list[str], device: str, names: list[str] | None = None) -> dict[str, list[Row]]:
    """`name|dtype` -> rows, for every check (or those named) in every dtype."""
    results = {}
    for name in names or KERNEL_CHECKS:
        fn, kwargs = KERNEL_CHECKS[name]
        for dtype in dtypes:
            results[f"{name}|{dtype}"] = fn(DTYPES[dtype], device, **kwargs)
    return results


# ---------------------------------------------------------------- the whole model


@torch.inference_mode()
def greedy_run(path: str, backend_name: str, dtype: torch.dtype, device: str, prompts: list[list[int]],
               max_new_tokens: int, block_size: int = 4, chunk: int = 6, forced: list[list[int]] | None = None,
               library=None):
    """Greedy generation through meshserve's model (one rank) with the named backend, in
    steps that mix prefill chunks (after a cached prefix), decodes and a late arrival;
    block tables with holes. With `forced`, those tokens are fed instead of the argmax
    (teacher forcing, to compare logits step by step). Returns (tokens, last-row logits
    of every sampled position). `library`: the C++ CPU kernels the cpu backend and the
    products call (default on the CPU: the fastest build, cpu_library.load, as the engine)."""
    from meshserve.comm.groups import AxisGroup
    from meshserve.layers.kernels import cpu_library
    from meshserve.configs.model_info import read_model_info
    from meshserve.layers.backend import select_backend
    from meshserve.layers.loader import build_model

    info = read_model_info(path)
    if library is None and torch.device(device).type == "cpu":
        library = cpu_library.load()
    model = build_model(info, AxisGroup.single("tp"), dtype, device=device, max_position=512,
                        backend=select_backend(backend_name, device, library), library=library)
    backend = model.backend
    max_len = max(len(p) for p in prompts) + max_new_tokens
    per_seq = -(-max_len // block_size)
    num_blocks = 2 * per_seq * len(prompts) + 1
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [ids[2 * i * per_seq:2 * (i + 1) * per_seq:2] for i in range(len(prompts))]
    kv_heads = model.model.layers[0].self_attn.local_num_kv_heads
    shape = (num_blocks, block_size, kv_heads, info.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in model.model.layers]
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    generated: list[list[int]] = [[] for _ in prompts]
    logits_out: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = 0
    while any(len(gen) < max_new_tokens for gen in generated):
        live = [i for i in range(len(prompts)) if len(generated[i]) < max_new_tokens and (i < 2 or step >= 2)]
        qlens = [min(chunk, len(tokens[i]) - done[i]) for i in live]
        input_ids = [t for i, n in zip(live, qlens) for t in tokens[i][done[i]:done[i] + n]]
        positions = [p for i, n in zip(live, qlens) for p in range(done[i], done[i] + n)]
        meta = backend.build_metadata(qlens, [done[i] + n for i, n in zip(live, qlens)], [tables[i] for i in live],
                                      block_size, device)
        hidden, _ = model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), caches, meta)
        row = 0
        sample_rows, sampled = [], []
        for i, n in zip(live, qlens):
            row += n
            done[i] += n
            if done[i] == len(tokens[i]):
                sample_rows.append(row - 1)
                sampled.append(i)
        if sample_rows:
            logits = model.compute_logits(hidden[sample_rows])
            for i, lg in zip(sampled, logits):
                token = forced[i][len(generated[i])] if forced else int(lg.argmax())
                generated[i].append(token)
                tokens[i].append(token)
                logits_out[i].append(lg.float().cpu())
        step += 1
    return generated, [torch.stack(lg) for lg in logits_out]


MODEL_PROMPTS = [[1, 504, 3575, 288, 2245, 314, 4469, 30, 216], [1, 9519, 28, 452, 1070, 5486, 28, 15470, 29, 730, 43,
                                                                  6025, 446], [1, 2, 3]]


def compare_backends(path: str, dtype: torch.dtype, device: str, max_new_tokens: int = 6,
                     other: str = "triton", library=None) -> dict:
    """Greedy tokens of the torch backend and `other`; then `other` teacher-forced with the
    torch tokens, and the largest logit difference over all those steps. `library`: as
    greedy_run's, for both models (the same products)."""
    want, want_logits = greedy_run(path, "torch", dtype, device, MODEL_PROMPTS, max_new_tokens, library=library)
    got, _ = greedy_run(path, other, dtype, device, MODEL_PROMPTS, max_new_tokens, library=library)
    _, forced_logits = greedy_run(path, other, dtype, device, MODEL_PROMPTS, max_new_tokens, forced=want,
                                  library=library)
    diff = max(err(a, b) for a, b in zip(forced_logits, want_logits))
    scale = max(float(lg.abs().max()) for lg in want_logits)
    return {"torch": want, other: got, "logits_max_diff": diff, "logits_scale": scale}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("what", choices=["kernels", "model"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16"], choices=list(DTYPES))
    ap.add_argument("--model-path")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    torch.set_num_threads(1)
    if args.what == "kernels":
        out = run_kernel_checks(args.dtypes, args.device)
    else:
        out = {d: compare_backends(args.model_path, DTYPES[d], args.device) for d in args.dtypes}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
