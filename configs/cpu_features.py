"""What this x86 CPU can compute fast, read from the kernel's CPU flags (no torch).

The C++ kernels (meshserve.layers.kernels.cpu_library) come in builds per instruction set,
and some paths need instructions that not every x86 CPU has: oneDNN's u8 x s8 product
(model.quantization=w8a8) needs VNNI, or it falls to a slow path whose 16-bit pair sums
saturate. Config validation asks here before any rank starts, so a path the CPU cannot run
correctly is refused with the feature it lacks instead of serving wrong answers.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

ISAS = ("avx512", "avx2", "scalar")
"""Builds of meshserve's C++ CPU kernels, fastest first: `avx512` (AVX-512 F/BW/VL/DQ),
`avx2` (AVX2 + FMA + F16C), `scalar` (the x86-64 baseline, for any CPU)."""

ISA_FLAGS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "scalar": (),
}
"""The CPU flags (as /proc/cpuinfo names them) each build's instructions need."""


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]
    known: bool = True
    """False where the flags could not be read (not Linux, not x86): then only the scalar
    build runs, and no path is refused for a missing feature."""

    @property
    def vnni(self) -> bool:
        """u8 x s8 dot products into int32 (AVX512-VNNI or AVX-VNNI), or AMX's int8 tiles."""
        return not self.known or bool(self.flags & {"avx512_vnni", "avx_vnni", "amx_int8"})

    @property
    def bf16_compute(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 or AMX): without them oneDNN widens
        bf16 to float32 around every multiply, slower than float32 itself."""
        return not self.known or bool(self.flags & {"avx512_bf16", "amx_bf16"})

    @property
    def amx_bf16(self) -> bool:
        """AMX's bf16 tiles (TDPBF16PS): meshserve's AMX product (cpu_amx_linear.cpp) runs.
        Never assumed where the flags are unknown: the instructions fault without them."""
        return self.known and {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def amx_int8(self) -> bool:
        """AMX's int8 tiles (TDPBUSD): the w8a8 product on them (cpu_amx_linear.cpp) runs.
        Never assumed where the flags are unknown."""
        return self.known and {"amx_tile", "amx_int8"} <= self.flags

    def runs(self, isa: str) -> bool:
        if isa not in ISA_FLAGS:
            raise ValueError(f"unknown CPU kernel build {isa!r} ({', '.join(ISAS)})")
        if not self.known:
            return isa == "scalar"
        return all(flag in self.flags for flag in ISA_FLAGS[isa])

    @property
    def runnable_isas(self) -> tuple[str, ...]:
        """The kernel builds this CPU runs, fastest first."""
        return tuple(isa for isa in ISAS if self.runs(isa))

    @property
    def best_isa(self) -> str:
        return self.runnable_isas[0]

    def describe(self) -> str:
        """One line for logs and error messages, e.g. `AVX2 FMA, no AVX-512, no VNNI, no AMX`."""
        if not self.known:
            return "CPU features unknown"
        parts = ["AVX-512" if self.runs("avx512") else "no AVX-512", "AVX2 FMA" if self.runs("avx2") else "no AVX2"]
        parts.append("VNNI" if self.vnni else "no VNNI")
        parts.append("AVX512-BF16" if "avx512_bf16" in self.flags else "no AVX512-BF16")
        parts.append("AMX" if "amx_tile" in self.flags else "no AMX")
        return ", ".join(parts)


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The flags of the first processor in /proc/cpuinfo's text."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return CpuFeatures(frozenset(value.split()))
    return CpuFeatures(frozenset(), known=False)


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's CPU features (unknown, so nothing refused, off Linux x86)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return CpuFeatures(frozenset(), known=False)
    try:
        return parse_cpuinfo(CPUINFO.read_text())
    except OSError:
        return CpuFeatures(frozenset(), known=False)


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, as a launcher set it)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
