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
