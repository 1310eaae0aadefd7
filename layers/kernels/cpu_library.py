"""meshserve's C++ kernels for the CPU, built with torch's extension builder the first
time a process needs them and cached on disk by torch: the paged decode attention
(cpu_decode_attention.cpp) and the causal attention of a prompt's first chunk
(cpu_prefill_attention.cpp), both wrapped by cpu_attention.py, the w8a8 linears' row
quantization and the int8 KV cache's (cpu_quantize_rows.cpp, used by meshserve.layers.quant
and meshserve.layers.kv_quant), and RMSNorm,
silu-and-mul (for the cpu backend's eager steps) and greedy sampling's argmax in one pass
each (cpu_norm_act.cpp).

`available()` builds (or loads) the library once and says whether it worked: without a C++
compiler the callers keep their torch-op paths.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_decode_attention.cpp", "cpu_prefill_attention.cpp", "cpu_quantize_rows.cpp",
                        "cpu_norm_act.cpp")]

ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
"""Compiler flags per instruction set torch detected on this CPU; the library's name
carries the set, so a cache shared by different machines never loads a wrong build."""


@functools.cache
def available() -> bool:
    """Builds and loads the kernel library (once per process); False if that fails."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    # NOTE: -fopenmp: at::parallel_for is inline OpenMP; without it the kernels run on one
    # thread. The OpenMP runtime is torch's own, already loaded (nothing more is linked).
    try:
        cpp_extension.load(name=f"meshserve_cpu_kernels_{capability.lower()}", sources=[str(s) for s in SOURCES],
                           extra_cflags=["-O3", "-ffast-math", "-fopenmp", *ISA_FLAGS.get(capability, [])],
                           is_python_module=False)
    except (OSError, RuntimeError) as e:
        log.warning("could not build meshserve's C++ CPU kernels (%s); decode attention gathers the cache and "
                    "calls SDPA instead, and w8a8 quantizes its inputs in torch ops", e)
        return False
    torch.library.register_fake("meshserve_cpu::paged_decode_attention")(_paged_decode_attention_shape)
    torch.library.register_fake("meshserve_cpu::prefill_attention")(_prefill_attention_shape)
    torch.library.register_fake("meshserve_cpu::quantize_rows_u8")(_quantize_rows_u8_shape)
    torch.library.register_fake("meshserve_cpu::scale_rows_")(_scale_rows_shape)
    torch.library.register_fake("meshserve_cpu::w8a8_linear")(_w8a8_linear_shape)
    torch.library.register_fake("meshserve_cpu::quantize_kv_int8")(_quantize_kv_int8_shape)
    torch.library.register_fake("meshserve_cpu::rms_norm")(_rms_norm_shape)
    torch.library.register_fake("meshserve_cpu::silu_and_mul")(_silu_and_mul_shape)
    torch.library.register_fake("meshserve_cpu::argmax_rows")(_argmax_rows_shape)
    return True


def _paged_decode_attention_shape(q, k_cache, v_cache, block_tables, seq_lens, scale):
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
