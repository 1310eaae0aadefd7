"""Tokenizer of the served model (Hugging Face fast tokenizer, from a directory or from
the GGUF file itself) and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from tokenizers.decoders import DecodeStream

from meshserve.configs.model_info import ModelInfo


class Tokenizer:
    def __init__(self, info: ModelInfo, path: str | None = None):
        from transformers import AutoTokenizer  # heavy import, only where a tokenizer is needed

        source = Path(path or info.path)
        if source.is_file():
            self._tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        else:
            self._tok = AutoTokenizer.from_pretrained(str(source))
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
