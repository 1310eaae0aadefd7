"""GGUF metadata as plain Python values (the gguf package parses; this only flattens)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf


@lru_cache(maxsize=2)
def open_gguf(path: str) -> gguf.GGUFReader:
    """A memory-mapped reader; cached because parsing the tokenizer arrays takes seconds."""
    return gguf.GGUFReader(path)


def read_gguf_header(path: Path | str) -> tuple[dict[str, Any], set[str]]:
    """Scalar and string metadata (arrays reduced to `<key>.count`) and the tensor names."""
    reader = open_gguf(str(path))
    meta: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if fld.types and fld.types[0] == gguf.GGUFValueType.ARRAY:
            meta[f"{name}.count"] = len(fld.data)
        else:
            meta[name] = fld.contents()
    return meta, {t.name for t in reader.tensors}
