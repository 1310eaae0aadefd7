"""What a draft-heads file (meshserve.layers.medusa) must say of itself to serve a model, read
from its safetensors header alone: the check before any rank starts and the loader's are one."""

from __future__ import annotations

from pathlib import Path

from meshserve.configs.safetensors_header import read_header

FILE_FORMAT = "meshserve-medusa"


def read_metadata(path: Path) -> dict[str, str]:
    """The safetensors header's `__metadata__` (OSError or ValueError where it is no such file)."""
    return read_header(path).get("__metadata__") or {}


def file_problem(meta: dict[str, str], hidden_size: int, vocab_size: int) -> str | None:
    """Why a heads file with this metadata cannot serve a model of these sizes, or None."""
    if meta.get("format") != FILE_FORMAT:
        return (f"not a Medusa heads file (metadata format={meta.get('format')!r}, expected {FILE_FORMAT!r}; "
                f"scripts/train_heads.py writes one)")
    if meta.get("hidden_size") != str(hidden_size):
        return f"heads for hidden_size={meta.get('hidden_size')}, the model has {hidden_size}"
    if meta.get("target_vocab_size") != str(vocab_size):
        return f"heads for a vocabulary of {meta.get('target_vocab_size')} tokens, the model has {vocab_size}"
    return None


MAX_TREE_NODES = 15
"""The most nodes of a candidate tree: a verify step's rows (the last token and the nodes)
must attend as decode rows, which alone can skip the keys of other branches
(layers.attention.DECODE_ROWS, 16 rows)."""


def tree_problem(paths: list[list[int]], num_heads: int | None = None) -> str | None:
    """Why `paths` is no candidate tree (engine/speculative/tree.py TreeShape) for heads of
    `num_heads` (None: any), or None."""
    if not paths or any(not p or min(p) < 0 for p in paths):
        return "a tree shape is a non-empty list of non-empty paths of guess indices (0: the first)"
    nodes = {tuple(p) for p in paths}
    missing = sorted(p[:-1] for p in nodes if len(p) > 1 and p[:-1] not in nodes)
    if missing:
        return f"tree path {list(missing[0])} is missing (every prefix of a path must be a path)"
    if len(nodes) > MAX_TREE_NODES:
        return f"a tree of {len(nodes)} nodes; at most {MAX_TREE_NODES} (a verify step's rows must attend as decode rows)"
    depth = max(map(len, nodes))
    if num_heads is not None and depth > num_heads:
        return f"a tree {depth} deep needs {depth} heads, the heads file has {num_heads}"
    return None
