"""Tokenizer of the served model (Hugging Face fast tokenizer, from a directory or from
the GGUF file itself) and incremental detokenization."""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

from tokenizers.decoders import DecodeStream

from meshserve.configs.cache import CACHE_ROOT, file_key
from meshserve.configs.model_info import ModelInfo


def load_tokenizer(source: Path, cache_root: Path | None = CACHE_ROOT):
    """A Hugging Face tokenizer from a directory, or from a GGUF file. transformers converts
    a GGUF's tokenizer in ~9 s (it parses the file's vocabulary again); the converted
    tokenizer is saved under `cache_root` (None: not cached) and a later start loads that
    in under a second."""
    from transformers import AutoTokenizer  # heavy import, only where a tokenizer is needed

    if not source.is_file():
        return AutoTokenizer.from_pretrained(str(source))
    if cache_root is None:
        return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    saved = cache_root / "tokenizers" / file_key(source, version("transformers"), version("tokenizers"))
    if (saved / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except (OSError, ValueError):
            pass
    tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    staging = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=saved.parent, prefix=f".{saved.name}."))
        tok.save_pretrained(str(staging))
        os.replace(staging, saved)  # a complete folder or none
    except OSError:  # read-only home, or another start renamed its copy first
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return tok


class Tokenizer:
    def __init__(self, info: ModelInfo, path: str | None = None):
        self._tok = load_tokenizer(Path(path or info.path))
        self._backend = self._tok.backend_tokenizer
        self.eos_token_ids = tuple(info.eos_token_ids) or ((self._tok.eos_token_id,) if self._tok.eos_token_id is not None else ())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._tok.encode(text, add_special_tokens=False)

    def detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self._backend, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Text of one sequence, token by token. A token that ends inside a multi-byte UTF-8
    character yields "" until the character completes, so no broken text is emitted."""

    CONTEXT_TOKENS = 6
    """Prompt tokens decoded first, so the first output token gets the spacing it has in
    context (SentencePiece tokenizers drop a leading space at the start of a text)."""

    def __init__(self, backend, prompt_ids: list[int], skip_special_tokens: bool):
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # NOTE: stepped through, not passed as `ids=`: a prompt ending inside a multi-byte
        # character would otherwise come out again as the first chunk of the output.
        for token_id in prompt_ids[-self.CONTEXT_TOKENS:]:
            self._stream.step(backend, token_id)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""
