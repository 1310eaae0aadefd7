"""The weight quantizations of the linear layers (config model.quantization), one type from
the config to the kernels: the schema parses the config's string into it, and the memory
plan, the checks, the matmul plan of the layers (meshserve.layers.matmul_plan) and the
MFU/MBU cost read it."""

from __future__ import annotations

from meshserve.configs.wire_enum import WireEnum


class Quantization(WireEnum):
    """`none`: the weights in model.dtype. `int8`: one scale per output row. `int4`: groups
    of 32 inputs with a scale and min each (GGUF's Q4_1 layout; the LM head takes int8).
    `w8a8`: int8 weights times activations quantized to 8 bits per row."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    W8A8 = "w8a8"

    @property
    def quantized(self) -> bool:
        return self is not Quantization.NONE

    @property
    def head(self) -> Quantization:
        """The LM head's: int8 when the layers take int4 (as GGUF files keep their output
        matrix at 8 bits), else the layers'."""
        return Quantization.INT8 if self is Quantization.INT4 else self
