"""meshserve's kernels. Triton (the `[gpu]` extra): paged decode and prefill attention, both
returning the log-sum-exp; RMSNorm fused with the residual add; rotary applied in place.
C++ for the CPU (`cpu_library.py`: one build per instruction set, AVX-512, AVX2 or scalar,
made on the first start of an install): paged decode and causal prefill attention
(`cpu_attention.py`), the w8a8 linears' quantize-multiply-rescale, the int8 KV cache's
quantizer, and one-pass RMSNorm, silu-and-mul and argmax.

One file per kernel, each with its Python wrapper; `triton_backend.py` and `cpu_backend.py`
put them behind the `Backend` interface the model uses (meshserve.layers.backend), each
with the per-step metadata type its kernels read. Nothing imports triton until
one of those modules is imported, so this package loads on a machine without it.

NOTE: under TRITON_INTERPRET=1 the kernels run on CPU tensors (thousands of times slower):
that is how the tests check them without a GPU. Triton reads the variable when a kernel is
defined, so it must be set before the first kernel module is imported. bf16 `tl.dot` is wrong
in the interpreter: interpreter tests use float32 and float16.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Whether triton is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
