"""OpenAI's HTTP API as meshserve serves it: request models, errors, and the response and
stream-chunk shapes of /v1/completions and /v1/chat/completions.

Requests are pydantic models that refuse unknown fields, as OpenAI's API does (a typo such
as `max_token` is a 400, not silently ignored). Parameters meshserve cannot honour
(penalties, logit_bias, echo, tools, ...) are a 400 naming the parameter unless they are
left at their no-op value. Extensions (vLLM's names): top_k, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from meshserve.comm import messages as bounds
from meshserve.comm.messages import Completion, Delta, ErrorCode, SamplingParams, TokenLogprob, Usage
from meshserve.engine.admission import RequestError, check_params

MAX_N = 128
"""Most samples (n x prompts) one HTTP request may ask for."""


class OpenAIError(Exception):
    """An error response: status code and OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# How the engine's error codes (comm.messages.ErrorCode) reach HTTP clients.
ENGINE_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "bad_request": (400, "invalid_request_error", None),
    "too_long": (400, "invalid_request_error", "context_length_exceeded"),
    "overloaded": (429, "rate_limit_error", "overloaded"),
    "duplicate_id": (409, "invalid_request_error", "duplicate_id"),
    "internal": (500, "server_error", "internal_error"),
    "unavailable": (503, "service_unavailable_error", "unavailable"),
    "unauthorized": (401, "invalid_request_error", "invalid_api_key"),
}


def engine_error(code: ErrorCode, message: str, param: str | None = None) -> OpenAIError:
    status, type_, openai_code = ENGINE_ERRORS.get(code, (500, "server_error", code))
    if code == "bad_request" or code == "too_long":
        return OpenAIError(status, message, type_, param, openai_code)
    return OpenAIError(status, message, type_, None, openai_code)


def from_request_error(e: RequestError, prompt_param: str) -> OpenAIError:
    """`prompt_param`: what the prompt is called in this request ("prompt", or "messages")."""
    return engine_error(e.code, e.message, prompt_param if e.param == "prompt" else e.param)


_MSGSPEC_PATH = re.compile(r"at `\$\.(\w+)")


# ---------------------------------------------------------------- requests


def field(meta: msgspec.Meta):
    """The pydantic Field of a bound declared once as msgspec Meta (comm/messages.py)."""
    keys = ("ge", "gt", "le", "lt", "min_length", "max_length")
    return Field(**{k: getattr(meta, k) for k in keys if getattr(meta, k) is not None})


class _Strict(BaseModel):
    """No coercions: "no" is not a bool, true not a token id. Fields meshserve does not know
    are kept aside (pydantic's model_extra) and ignored, as vLLM ignores them: clients send
    other servers' extensions (guidellm always sends stream_options.continuous_usage_stats),
    and refusing what changes nothing breaks them. `ignored_fields` names them for the
    log and the response; the known ones that would change the output are refused
    (UNSUPPORTED)."""

    model_config = ConfigDict(extra="allow", strict=True)


UNSUPPORTED: dict[str, Any] = {
    "repetition_penalty": 1.0, "min_p": 0.0, "typical_p": 1.0, "length_penalty": 1.0, "use_beam_search": False,
    "prompt_logprobs": None, "logits_processors": None, "truncate_prompt_tokens": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "structured_outputs": None, "add_generation_prompt": True, "continue_final_message": False,
    "chat_template": None, "chat_template_kwargs": None, "mirostat": 0, "n_probs": 0,
    "include_stop_str_in_output": False, "functions": None, "function_call": None,
}
"""Other servers' parameters that change what is generated (vLLM's and llama.cpp's names),
each with the value that changes nothing: any other value is refused, not ignored."""


TYPO_CUTOFF = 0.85
"""An unknown field this close to a known one (difflib's ratio) is taken for a misspelling
and refused (`max_token`, `temprature`); other unknown fields are ignored."""


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The dotted names of the fields of a request (nested ones too) that its model does not
    know; items of a list share one name (`messages[].refusal`)."""
    out = [prefix + name for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        seen: set[str] = set()
        for item in items:
            if isinstance(item, BaseModel):
                nested = f"{prefix}{name}[]." if isinstance(value, list) else f"{prefix}{name}."
                seen.update(ignored_fields(item, nested))
        out += sorted(seen)
    return out


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension: every chunk carries the usage so far."""


class _SamplingRequest(_Strict):
    """Fields common to completions and chat completions."""

    model: str | None = None
    max_tokens: Annotated[int, field(bounds.MAX_TOKENS)] | None = None
    temperature: Annotated[float, field(bounds.TEMPERATURE)] | None = None
    top_p: Annotated[float, field(bounds.TOP_P)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[int, field(bounds.SEED)] | None = None
    stop: str | Annotated[list[str], field(bounds.STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: Annotated[int, Field(ge=-1, le=bounds.COUNT.le)] | None = None
    """-1 or 0: off; at most the vocabulary's size."""
    min_tokens: Annotated[int, field(bounds.COUNT)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, field(bounds.COUNT)]], field(bounds.STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Share cached KV blocks only with requests of the same salt."""

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            typo = difflib.get_close_matches(name, type(self).model_fields, n=1, cutoff=TYPO_CUTOFF)
            if typo and name not in UNSUPPORTED:
                raise OpenAIError(400, f"{name}: unknown parameter (did you mean {typo[0]}?)", param=name,
                                  code="invalid_value")
            if name in UNSUPPORTED and value != UNSUPPORTED[name]:
                only = "" if UNSUPPORTED[name] is None else f" (only {UNSUPPORTED[name]!r})"
                raise OpenAIError(400, f"{name}={repr(value)[:80]} is not supported by this server{only}", param=name,
                                  code="unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise OpenAIError(400, f"{name}={value} is not supported by this server (only 0)", param=name,
                                  code="unsupported_parameter")
        if self.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported by this server", param="logit_bias",
                              code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
        """The engine's parameters for one sample; `seed` already offset for this sample."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields = {"max_tokens": max_tokens, "min_tokens": self.min_tokens, "top_k": max(0, self.top_k or 0),
                  "seed": seed, "stop": stop, "stop_token_ids": list(self.stop_token_ids or []),
                  "ignore_eos": self.ignore_eos, "logprobs": logprobs,
                  "skip_special_tokens": self.skip_special_tokens}
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        try:
            return msgspec.convert(fields, SamplingParams)
        except msgspec.ValidationError as e:
            m = _MSGSPEC_PATH.search(str(e))
            raise OpenAIError(400, str(e), param=m.group(1) if m else None) from None

    def check_params(self, params: SamplingParams, vocab_size: int) -> None:
        try:
            check_params(params, vocab_size)
        except RequestError as e:
            raise engine_error(e.code, e.message, e.param) from None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt | None = None
    """Decoded and bounded by request_body.parse_body, which fills it in after validating the
    other fields: a pydantic union over a million token ids would hold the event loop."""
    logprobs: Annotated[int, field(bounds.LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise OpenAIError(400, "echo is not supported by this server", param="echo", code="unsupported_parameter")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported by this server", param="suffix",
                              code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(400, f"best_of={self.best_of} is not supported (only best_of == n)", param="best_of",
                              code="unsupported_parameter")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: a string, token ids, or a batch of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, field(bounds.LOGPROBS)] | None = None
    max_completion_tokens: Annotated[int, field(bounds.MAX_TOKENS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools or self.tool_choice not in (None, "none"):
            raise OpenAIError(400, "tools are not supported by this server", param="tools",
                              code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------- responses


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` (once known, at the end): prompt tokens whose KV
    came from the prefix cache."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def cached_tokens(usages: dict[int, Usage], n: int) -> int:
    """The usage's cached tokens: those of each prompt's first sample (sample i * n), as
    prompt_tokens counts each prompt once however many samples it has."""
    return sum(u.cached_tokens for index, u in usages.items() if index % n == 0)


class LogprobFormatter:
    """Token logprobs in the two shapes OpenAI uses (legacy completions, chat)."""

    def __init__(self, token_text):
        self.token_text = token_text
        """token id -> its text (cached by the caller)."""

    def completion(self, logprobs: list[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
        """Legacy `logprobs` object of the completions API, and the text offset after it."""
        tokens, offsets, tops = [], [], []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            top = {text: lp.logprob}
            for tid, value in lp.top:
                top.setdefault(self.token_text(tid), value)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": tops,
                "text_offset": offsets}, offset

    def chat(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        def entry(tid: int, value: float) -> dict[str, Any]:
            text = self.token_text(tid)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}


class CompletionShapes:
    """Choices of /v1/completions, whole or as stream chunks."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, logprobs: LogprobFormatter | None):
        self.logprobs = logprobs
        self._offsets: dict[int, int] = {}

    def _logprobs(self, index: int, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if self.logprobs is None or logprobs is None:
            return None
        out, self._offsets[index] = self.logprobs.completion(logprobs, self._offsets.get(index, 0))
        return out

    def choice(self, index: int, c: Completion) -> dict[str, Any]:
        return {"index": index, "text": c.text, "logprobs": self._logprobs(index, c.logprobs or []),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def chunk_choice(self, index: int, d: Delta) -> dict[str, Any]:
        return {"index": index, "text": d.text, "logprobs": self._logprobs(index, d.logprobs or []),
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}


class ChatShapes:
    """Choices of /v1/chat/completions, whole or as stream chunks."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, logprobs: LogprobFormatter | None):
        self.logprobs = logprobs
        self._started: set[int] = set()

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        return None if self.logprobs is None or logprobs is None else self.logprobs.chat(logprobs)

    def choice(self, index: int, c: Completion) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c.logprobs or []), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def chunk_choice(self, index: int, d: Delta) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": d.text}
        if index not in self._started:  # the first chunk of a choice names the role
            self._started.add(index)
            delta = {"role": "assistant"} | delta
        return {"index": index, "delta": delta, "logprobs": self._logprobs(d.logprobs or []),
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
