"""vLLM's tokenizer endpoints, in vLLM's shapes, and the chat template as every HTTP path applies it.

    POST /tokenize {"prompt": "Hello world"}              -> {"count": 2, "max_model_len": 512,
                                                              "tokens": [19556, 905], "token_strs": null}
    POST /tokenize {"messages": [...], "add_generation_prompt": true, "return_token_strs": true}
    POST /detokenize {"tokens": [19556, 905]}              -> {"prompt": "Hello world"}
    GET /tokenizer_info                                     -> {"tokenizer_class", "chat_template", "eos_token",
                                                                "model_max_length" (= max_model_len), ...}
    GET /version                                            -> {"version": "0.1.0"}

A prompt is tokenized with the tokenizer's special tokens (add_special_tokens, default true),
messages without them (the template writes its own), as vLLM does. Nothing here reaches the
engine; the tokenizing runs on the HTTP frontend's tokenize pool, off the event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from pydantic import Field

from meshserve.comm import messages as bounds
from meshserve.engine.admission import RequestError, check_chars
from meshserve.engine.serving.openai_protocol import (ChatMessage, OpenAIError, _Strict, check_model,
                                                      check_template_flags, field, from_request_error)
from meshserve.engine.serving.request_body import parse_fields, split_fields
from meshserve.engine.tokenizer import Tokenizer

InPool = Callable[..., Awaitable[Any]]
"""run(size, fn, *args): fn(*args) on the tokenize pool (shortest `size` first)."""


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    """Filled by request_body.parse_fields (which bounds it before decoding it)."""
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, field(bounds.COUNT)]]
    """At most what MAX_FIELD_BYTES of JSON hold (request_body.py)."""


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                add_special_tokens: bool = False) -> list[int]:
    """The token ids of `messages` through the model's chat template (on a worker thread:
    rendering and tokenizing a long conversation takes a while)."""
    try:
        text = tokenizer.render_chat(messages, add_generation_prompt, continue_final_message, template_kwargs)
    except Exception as e:  # noqa: BLE001 - the template refuses (roles out of order, a kwarg it cannot take)
        raise OpenAIError(400, f"the chat template failed: {e}", param="messages") from None
    return tokenizer.encode_text(text, add_special_tokens)


def template_input(messages: list[ChatMessage], max_model_len: int) -> tuple[list[dict[str, str]], int]:
    """The messages as the template takes them, and their characters, refused unread if far
    longer than the context."""
    inputs = [m.as_template_input() for m in messages]
    chars = sum(len(m["content"]) for m in inputs)
    try:
        check_chars(chars, max_model_len, "messages")
    except RequestError as e:
        raise from_request_error(e, "messages") from None
    return inputs, chars


def meshserve_version() -> str:
    try:
        return version("meshserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class TokenizerApi:
    """The handlers of /tokenize, /detokenize and /tokenizer_info for one served model."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, model_name: str, in_pool: InPool,
                 check: Callable[[str | None], object] | None = None):
        """`check(model)`: raises OpenAIError for a `model` the server does not serve (default:
        any name but `model_name`; a LoRA adapter's name is served too, with the base's tokenizer)."""
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.model_name, self._in_pool = model_name, in_pool
        self._check = check or (lambda model: check_model(model, model_name))
        self._info: dict[str, Any] | None = None

    async def tokenize(self, body: bytes) -> dict[str, Any]:
        req = self._parse_tokenize(body)
        self._check(req.model)
        if isinstance(req, TokenizeChatRequest):
            check_template_flags(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
            messages, chars = template_input(req.messages, self.max_model_len)
            ids = await self._in_pool(chars + len(messages), encode_chat, self.tokenizer, messages,
                                      req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
                                      req.add_special_tokens)
        else:
            try:
                check_chars(len(req.prompt), self.max_model_len)
            except RequestError as e:
                raise from_request_error(e, "prompt") from None
            ids = await self._in_pool(len(req.prompt), self.tokenizer.encode_text, req.prompt,
                                      req.add_special_tokens)
        strs = await self._in_pool(len(ids), self.tokenizer.token_strs, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def _parse_tokenize(self, body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
        """vLLM's two request shapes, told apart by `messages`."""
        fields = split_fields(body)
        if "messages" in fields and "prompt" in fields:
            raise OpenAIError(400, "give either prompt or messages, not both", param="prompt", code="invalid_value")
        if "messages" in fields:
            return parse_fields(fields, TokenizeChatRequest, self.max_model_len)
        req = parse_fields(fields, TokenizeCompletionRequest, self.max_model_len)
        if not isinstance(req.prompt, str):
            raise OpenAIError(400, "prompt must be a string (or send messages)", param="prompt", code="invalid_value")
        return req

    async def detokenize(self, body: bytes) -> dict[str, Any]:
        req = parse_fields(split_fields(body), DetokenizeRequest, self.max_model_len)
        self._check(req.model)
        bad = [t for t in req.tokens if t >= self.vocab_size]
        if bad:
            raise OpenAIError(400, f"token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})",
                              param="tokens", code="invalid_value")
        # NOTE: special tokens stay in the text, as vLLM's /detokenize keeps them
        text = await self._in_pool(len(req.tokens), self.tokenizer.decode, req.tokens, False)
        return {"prompt": text}

    def info(self) -> dict[str, Any]:
        """vLLM's GET /tokenizer_info, with model_max_length the served context (max_model_len)."""
        if self._info is None:
            self._info = self.tokenizer.info() | {"model_max_length": self.max_model_len}
        return self._info
