"""meshserve's C++ kernels for the CPU: the paged decode attention (cpu_decode_attention.cpp)
and the causal attention of a prompt's first chunk (cpu_prefill_attention.cpp), both wrapped
by cpu_attention.py, the w8a8 linears' row quantization and the int8 KV cache's
(cpu_quantize_rows.cpp, used by meshserve.layers.quant and meshserve.layers.kv_quant), and
RMSNorm, silu-and-mul and rotary (for the cpu backend's eager steps) and greedy sampling's argmax in one
pass each (cpu_norm_act.cpp), and random sampling with temperature, top-k and top-p
(cpu_sample.cpp, with the grammar masks of structured outputs), and the products of float32
and bfloat16 weights in panels on AVX2 CPUs (cpu_dense_linear.cpp, used by
meshserve.layers.matmul), and a run of Llama decoder layers over a decode step in one call
of those kernels (cpu_decode_layers.cpp, used by meshserve.layers.fused_decode), and the
LoRA products of a batch whose rows use different adapters (cpu_lora.cpp, Punica's BGMV).

**One build per instruction set** (meshserve.configs.cpu_features.ISAS): `avx512`, `avx2`,
`scalar`. Each registers its ops under its own namespace (`torch.ops.meshserve_cpu_avx2`,
...), so several load side by side in one process and the tests run every build this CPU
can execute against the same references. `load(isa)` gives one build as a `CpuLibrary` (its
instruction set and its ops); `auto` is the fastest this CPU runs (config device.cpu_isa). The
engine loads it once and passes it to what calls its ops (the cpu backend, the products, the
sampler): no module holds a selected build.

**Built once per install.** Each build goes into a folder of its own under
~/.cache/meshserve/kernels, named by a hash of the sources' path and text, the compiler
flags, and the torch and Python builds: two installs never share (and so never rebuild)
one folder, and a second start loads the library without calling the compiler. Builders
of one folder take an flock (released by the kernel when a builder dies); a torch build
lock found while holding it was left by an interrupted build, and is removed with a
warning instead of waiting on it for ever.

`load()` builds (or loads) the library once per process and gives None where that fails:
without a C++ compiler the callers keep their torch-op paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from meshserve.configs.artifact_cache import CACHE_ROOT
from meshserve.configs.cpu_features import ISAS, cpu_features

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent
SOURCE_NAMES = ("cpu_decode_attention.cpp", "cpu_prefill_attention.cpp", "cpu_quantize_rows.cpp", "cpu_norm_act.cpp",
                "cpu_sample.cpp", "cpu_dense_linear.cpp", "cpu_decode_layers.cpp", "cpu_amx_linear.cpp",
                "cpu_amx_attention.cpp", "cpu_lora.cpp")
HEADER_NAMES = ("cpu_vec.h", "cpu_amx.h", "cpu_prefill_chunks.h")
SOURCES = [KERNEL_DIR / name for name in SOURCE_NAMES]

ISA_CFLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
"""Compiler flags per build; `scalar` is the x86-64 baseline (SSE2), for any CPU."""

# NOTE: -fopenmp: at::parallel_for is inline OpenMP; without it the kernels run on one
# thread. The OpenMP runtime is torch's own, already loaded (nothing more is linked).
# -fvisibility=hidden: every build defines the same inline helpers; hidden, each library
# binds its own and never another build's (an AVX-512 helper in an AVX2 library would fault).
COMMON_CFLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]

KERNEL_CACHE = CACHE_ROOT / "kernels"


def namespace(isa: str) -> str:
    return f"meshserve_cpu_{isa}"


def cflags(isa: str) -> list[str]:
    return [*COMMON_CFLAGS, *ISA_CFLAGS[isa], f"-DMESHSERVE_NS={namespace(isa)}"]


def build_key(isa: str, source_dir: Path = KERNEL_DIR) -> str:
    """What the built library depends on: where the sources are (the install) and what they
    say, the flags, and the torch and Python builds."""
    h = hashlib.sha256()
    for part in (str(source_dir), " ".join(cflags(isa)), torch.__version__, str(torch.version.git_version),
                 sys.version, platform.machine()):
        h.update(part.encode() + b"\0")
    for name in (*SOURCE_NAMES, *HEADER_NAMES):
        h.update(name.encode() + b"\0" + (source_dir / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build_directory(isa: str, root: Path = KERNEL_CACHE) -> Path:
    return root / f"{isa}-torch{torch.__version__.replace('+', '_')}-{build_key(isa)}"


@contextlib.contextmanager
def build_lock(directory: Path):
    """Exclusive use of a build folder. While it is held no other meshserve process builds
    there, so a torch `lock` file inside was left by an interrupted build: removed."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".flock"), "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is building meshserve's C++ kernels in %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing a stale build lock %s (left by a build that was interrupted)", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


BUILT_STAMP = "built"
"""Written next to the library once a build finished and loaded: a later start loads the
library directly, without asking the compiler whether it is up to date."""


def _build_or_load(isa: str, root: Path) -> None:
    from torch.utils import cpp_extension

    directory = build_directory(isa, root)
    name = namespace(isa)
    library = directory / f"{name}.so"
    if (directory / BUILT_STAMP).exists() and library.exists():
        torch.ops.load_library(str(library))
        return
    with build_lock(directory):
        if (directory / BUILT_STAMP).exists() and library.exists():  # another process built it meanwhile
            torch.ops.load_library(str(library))
            return
        log.info("building meshserve's C++ CPU kernels (%s build; first start of this install only) in %s",
                 isa, directory)
        start = time.perf_counter()
        cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=cflags(isa),
                           build_directory=str(directory), is_python_module=False)
        (directory / BUILT_STAMP).write_text(f"{time.perf_counter() - start:.1f} s\n")
        log.info("built meshserve's C++ CPU kernels (%s) in %.1f s", isa, time.perf_counter() - start)


@functools.cache
def library(isa: str, root: Path = KERNEL_CACHE):
    """The ops of the `isa` build (built or loaded once per process), or None when it cannot
    be built here (no C++ compiler). Raises for a build this CPU cannot run."""
    features = cpu_features()
    if isa not in ISAS:
        raise ValueError(f"unknown CPU kernel build {isa!r} ({', '.join(ISAS)})")
    if not features.runs(isa):
        raise ValueError(f"this CPU ({features.describe()}) cannot run the {isa} build of meshserve's C++ kernels "
                         f"(it runs {', '.join(features.runnable_isas)})")
    try:
        _build_or_load(isa, root)
    except (OSError, RuntimeError) as e:
        log.warning("could not build meshserve's C++ CPU kernels (%s); decode attention gathers the cache and "
                    "calls SDPA instead, and w8a8 quantizes its inputs in torch ops", e)
        return None
    ns = namespace(isa)
    for op, shape in SHAPES.items():
        torch.library.register_fake(f"{ns}::{op}")(shape)
    return getattr(torch.ops, ns)


@dataclass(frozen=True)
class CpuLibrary:
    """One loaded build of the C++ kernels: its instruction set and its op namespace."""

    isa: str
    """avx512 | avx2 | scalar."""
    ops: object
    """torch.ops.meshserve_cpu_<isa>: call its kernels as `ops.rms_norm(...)`."""


@functools.cache
def load(isa: str = "auto") -> CpuLibrary | None:
    """The `isa` build (`auto`: the fastest this CPU runs), or None when it cannot be built
    here. Cached: every caller of one build gets the same object."""
    resolved = cpu_features().best_isa if isa == "auto" else isa
    ops = library(resolved)
    return None if ops is None else CpuLibrary(resolved, ops)


def runnable_isas() -> tuple[str, ...]:
    """The builds this CPU runs, fastest first (what the tests run the kernels in)."""
    return cpu_features().runnable_isas


def _paged_decode_attention_shape(q, k_cache, v_cache, block_tables, seq_lens, scale, skip=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _prefill_attention_shape(q, k, v, chunks, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _quantize_rows_u8_shape(x):
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


def _scale_rows_shape(y, scales):
    return y


def _w8a8_linear_shape(x, packed, w_scale, w_zero):
    return x.new_empty((*x.shape[:-1], w_scale.shape[0]))


def _quantize_kv_int8_shape(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] + 4), dtype=torch.int8)


def _rms_norm_shape(x, weight, eps, residual):
    return torch.empty_like(x), torch.empty_like(x) if residual is not None else x.new_empty(0)


def _silu_and_mul_shape(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def _argmax_rows_shape(x):
    return x.new_empty(x.shape[0], dtype=torch.long)


def _sample_rows_shape(logits, temperature, top_k, top_p, uniform):
    return logits.new_empty(logits.shape[0], dtype=torch.long)


def _mask_rows_shape(logits, bitmask, rows):
    return logits.new_empty(rows.shape[0], dtype=torch.bool)


def _rotary_shape(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _dense_linear_shape(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _pack_panels_shape(weight):
    return torch.empty_like(weight)


def _panel_rows_shape(weight, ids):
    return weight.new_empty((*ids.shape, weight.shape[1]))


def _amx_linear_shape(x, packed, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _amx_linear_f32_shape(x, packed, out_features):
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32)


def _amx_pack_shape(weight):
    return weight.new_empty((-(-weight.shape[0] // 32), weight.shape[1] * 32), dtype=torch.bfloat16)


def _amx_w8a8_linear_shape(x, packed, w_scale, w_sums, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _amx_pack_s8_shape(codes):
    return codes.new_empty((-(-codes.shape[0] // 32), codes.shape[1] * 32))


def _lora_add_shape(y, x, slots, a, b):
    return None


SHAPES = {"paged_decode_attention": _paged_decode_attention_shape,
          "paged_tree_decode_attention": _paged_decode_attention_shape, "prefill_attention": _prefill_attention_shape,
          "amx_prefill_attention": _prefill_attention_shape,
          "quantize_rows_u8": _quantize_rows_u8_shape, "scale_rows_": _scale_rows_shape,
          "w8a8_linear": _w8a8_linear_shape, "quantize_kv_int8": _quantize_kv_int8_shape,
          "rms_norm": _rms_norm_shape, "silu_and_mul": _silu_and_mul_shape, "argmax_rows": _argmax_rows_shape,
          "sample_rows": _sample_rows_shape, "mask_rows": _mask_rows_shape, "dense_linear": _dense_linear_shape,
          "pack_panels": _pack_panels_shape, "panel_rows": _panel_rows_shape,
          "rotary": _rotary_shape, "amx_linear": _amx_linear_shape,
          "amx_linear_f32": _amx_linear_f32_shape, "amx_linear_silu": _amx_linear_shape, "amx_pack": _amx_pack_shape,
          "amx_w8a8_linear": _amx_w8a8_linear_shape, "amx_pack_s8": _amx_pack_s8_shape,
          "lora_add": _lora_add_shape}
"""Each op's shape function, for torch.compile."""
