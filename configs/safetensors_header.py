"""A safetensors file's JSON header, read without torch (the checks before any rank starts)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER = 100 << 20
"""The largest safetensors header read (the format's own limit)."""


def read_header(path: Path) -> dict:
    """Tensor name -> {dtype, shape, data_offsets}, and `__metadata__` if the file has one.
    ValueError: `is not a safetensors file` or `has a broken safetensors header`; OSError
    where it cannot be read."""
    with path.open("rb") as f:
        raw = f.read(8)
        size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < size <= MAX_HEADER:
            raise ValueError("is not a safetensors file")
        try:
            return json.loads(f.read(size))
        except ValueError:
            raise ValueError("has a broken safetensors header") from None
