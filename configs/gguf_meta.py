"""GGUF metadata as plain Python values (the gguf package parses; this only flattens)."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path
from typing import Any

import gguf

from meshserve.configs.artifact_cache import CACHE_ROOT, file_key, write_atomically


@lru_cache(maxsize=2)
def open_gguf(path: str) -> gguf.GGUFReader:
    """A memory-mapped reader; cached because parsing the tokenizer arrays takes seconds."""
    return gguf.GGUFReader(path)


HEADER_FORMAT = "1"
"""Version of the cached header's layout: bump it when read_gguf_header's output changes."""


def read_gguf_header(path: Path | str, cache_root: Path | None = CACHE_ROOT) -> tuple[dict[str, Any], set[str]]:
    """Scalar and string metadata (arrays reduced to `<key>.count`) and the tensor names.
    Parsing a header takes seconds (the tokenizer's arrays); the result is cached as JSON
    under `cache_root` (None: not cached)."""
    cached = None
    if cache_root is not None:
        cached = cache_root / "gguf" / (file_key(path, version("gguf"), HEADER_FORMAT) + ".json")
        try:
            data = json.loads(cached.read_text())
            return data["meta"], set(data["tensors"])
        except (OSError, ValueError, KeyError):
            pass
    reader = open_gguf(str(path))
    meta: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if fld.types and fld.types[0] == gguf.GGUFValueType.ARRAY:
            meta[f"{name}.count"] = len(fld.data)
        else:
            meta[name] = fld.contents()
    tensors = {t.name for t in reader.tensors}
    if cached is not None:
        try:
            write_atomically(cached, json.dumps({"meta": meta, "tensors": sorted(tensors)}).encode())
        except (OSError, TypeError, ValueError):  # a read-only home, or a value JSON cannot hold
            pass
    return meta, tensors
