"""Where meshserve keeps what it derives once from files that do not change: the C++
kernels it builds (meshserve.layers.kernels.cpu_library), tokenizers converted from GGUF
files (meshserve.engine.tokenizer) and GGUF headers (meshserve.configs.gguf_meta). A
second start of the same install reads these instead of redoing the work.

Entries are named by a hash of what they derive from (a file's path, size and mtime, plus
the versions that shape the result), so a changed file or package gets a new entry, and
are written under a temporary name and renamed into place, so a start that dies half-way
leaves nothing that a later start would trust.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

CACHE_ROOT = Path.home() / ".cache" / "meshserve"


def file_key(path: Path | str, *versions: str) -> str:
    """A name for what is derived from the file at `path` by code of `versions`."""
    p = Path(path).resolve()
    st = p.stat()
    h = hashlib.sha256("\0".join([str(p), str(st.st_size), str(st.st_mtime_ns), *versions]).encode())
    return h.hexdigest()[:16]


def write_atomically(path: Path, data: bytes) -> None:
    """Write `path` so that a reader sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
