"""Tokenizer of the served model (Hugging Face fast tokenizer, from a directory or from
the GGUF file itself) and incremental detokenization."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from meshserve.configs.artifact_cache import CACHE_ROOT, file_key
from meshserve.configs.model_info import ModelInfo


def load_tokenizer(source: Path, cache_root: Path | None = CACHE_ROOT):
    """A Hugging Face tokenizer from a directory, or from a GGUF file. transformers converts
    a GGUF's tokenizer slowly (it parses the file's vocabulary again); the converted
    tokenizer is saved under `cache_root` (None: not cached) and a later start loads that
    instead, much faster."""
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


_PATH_KEYS = frozenset({"name_or_path", "vocab_file", "merges_file", "tokenizer_file", "special_tokens_map_file",
                        "gguf_file", "cache_dir"})
"""Init arguments of a Hugging Face tokenizer that name files or directories."""
_NOT_JSON = object()


def _json_value(value: Any) -> Any:
    """`value` as JSON data (an AddedToken as its text), or _NOT_JSON."""
    if hasattr(value, "content") and isinstance(value.content, str):  # tokenizers' AddedToken
        return value.content
    if isinstance(value, float) and not math.isfinite(value):
        return _NOT_JSON
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_json_value(v) for v in value]
        return _NOT_JSON if any(v is _NOT_JSON for v in items) else items
    if isinstance(value, dict):
        items = {str(k): _json_value(v) for k, v in value.items()}
        return _NOT_JSON if any(v is _NOT_JSON for v in items.values()) else items
    return _NOT_JSON


class Tokenizer:
    def __init__(self, info: ModelInfo, path: str | None = None):
        self._tok = load_tokenizer(Path(path or info.path))
        self._backend = self._tok.backend_tokenizer
        self.eos_token_ids = tuple(info.eos_token_ids) or ((self._tok.eos_token_id,) if self._tok.eos_token_id is not None else ())

    @property
    def hf(self):
        """The Hugging Face tokenizer itself (for libraries that read its vocabulary)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._tok.encode(text, add_special_tokens=False)

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s token ids, with or without the special tokens the tokenizer adds (a BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template applied to `messages`: ending with the assistant's header
        (`add_generation_prompt`), or left open at the end of the last message so the model
        continues it (`continue_final_message`); `template_kwargs` are the template's own
        variables (vLLM's chat_template_kwargs). ValueError/TemplateError if the template refuses."""
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **(template_kwargs or {}))

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token's string in the vocabulary (byte-level pieces such as `Ġworld`, not text)."""
        return self._tok.convert_ids_to_tokens(token_ids)

    def info(self) -> dict[str, Any]:
        """The tokenizer's configuration as vLLM's GET /tokenizer_info gives it: its init
        arguments (JSON values only; special tokens as their text), `tokenizer_class` and
        `chat_template`. NOTE: without the fields that name files or directories: a client has
        no business with the server's paths."""
        config: dict[str, Any] = {}
        for key, value in self._tok.init_kwargs.items():
            value = _json_value(value)
            if key not in _PATH_KEYS and value is not _NOT_JSON:
                config[key] = value
        config["tokenizer_class"] = type(self._tok).__name__
        for name in ("bos_token", "eos_token", "chat_template"):
            if config.get(name) is None and isinstance(getattr(self._tok, name, None), str):
                config[name] = getattr(self._tok, name)
        return config

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
