"""OpenAI's HTTP API as meshserve serves it: request models, errors, and the response and
stream-chunk shapes of /v1/completions and /v1/chat/completions.

Requests are pydantic models that refuse unknown fields, as OpenAI's API does (a typo such
as `max_token` is a 400, not silently ignored). Parameters meshserve cannot honour
(suffix, prompt_logprobs, beam search, ...) are a 400 naming the parameter unless they are
left at their no-op value. Extensions (vLLM's names): top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output,
return_token_ids, truncate_prompt_tokens, cache_salt; on chat also echo,
add_generation_prompt, continue_final_message, chat_template_kwargs.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
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


def check_model(requested: str | None, served: str) -> None:
    """A request that names a model names the served one (else 404, as OpenAI answers)."""
    if requested is not None and requested != served:
        raise OpenAIError(404, f"The model `{requested}` does not exist (this server serves `{served}`)",
                          param="model", code="model_not_found")


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
    "typical_p": 1.0, "length_penalty": 1.0, "use_beam_search": False,
    "prompt_logprobs": None, "logits_processors": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "structured_outputs": None, "chat_template": None, "mirostat": 0, "n_probs": 0,
    "functions": None, "function_call": None,
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
    presence_penalty: Annotated[float, field(bounds.PENALTY)] | None = None
    frequency_penalty: Annotated[float, field(bounds.PENALTY)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, field(bounds.LOGIT_BIAS)]],
                          Field(max_length=bounds.MAX_LOGIT_BIAS)] | None = None
    """Token id (as a string, OpenAI's shape) -> bias added to its logit."""
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
    repetition_penalty: Annotated[float, field(bounds.REPETITION_PENALTY)] | None = None
    min_p: Annotated[float, field(bounds.MIN_P)] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    """The prompt's token ids and each choice's (vLLM 0.10's `prompt_token_ids`, `token_ids`)."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=bounds.INT32_MAX)] | None = None
    """Keep only the prompt's last k tokens; -1: the model's maximum context."""

    @property
    def num_samples(self) -> int:
        """Engine requests per prompt."""
        return self.n

    def prompt_keep(self, max_model_len: int) -> int | None:
        """How many of the prompt's last tokens to keep (truncate_prompt_tokens); None: all."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        if k == 0 or k > max_model_len:
            raise OpenAIError(400, f"truncate_prompt_tokens={k}: keep 1 to {max_model_len} prompt tokens (the model's "
                                   f"maximum context), or -1 for all it holds", param="truncate_prompt_tokens",
                              code="invalid_value")
        return max_model_len if k == -1 else k

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
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
        """The engine's parameters for one sample; `seed` already offset for this sample."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields = {"max_tokens": max_tokens, "min_tokens": self.min_tokens, "top_k": max(0, self.top_k or 0),
                  "seed": seed, "stop": stop, "stop_token_ids": list(self.stop_token_ids or []),
                  "ignore_eos": self.ignore_eos, "logprobs": logprobs,
                  "skip_special_tokens": self.skip_special_tokens,
                  "include_stop_str_in_output": self.include_stop_str_in_output, "logit_bias": self._logit_bias()}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        try:
            return msgspec.convert(fields, SamplingParams)
        except msgspec.ValidationError as e:
            m = _MSGSPEC_PATH.search(str(e))
            raise OpenAIError(400, str(e), param=m.group(1) if m else None) from None

    def _logit_bias(self) -> list[tuple[int, float]]:
        """OpenAI's logit_bias map as the engine's (token id, bias) pairs."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            # NOTE: not int(key) alone: it takes " 5", "+5", "1_0" and other digits than ASCII
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise OpenAIError(400, f"logit_bias: the key {key[:40]!r} is not a token id (a non-negative integer, "
                                       f"as a string)", param="logit_bias", code="invalid_value")
            pairs.append((int(key), bias))
        return sorted(pairs)

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
        if self.echo and self.logprobs is not None:
            # NOTE: echo with logprobs needs the prompt's logprobs (prompt_logprobs), not served yet
            raise OpenAIError(400, "echo together with logprobs is not supported by this server", param="echo",
                              code="unsupported_parameter")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported by this server", param="suffix",
                              code="unsupported_parameter")
        if self.best_of is not None and self.best_of < self.n:
            raise OpenAIError(400, f"best_of={self.best_of} must be at least n={self.n}", param="best_of",
                              code="invalid_value")
        if self.stream and self.num_samples > self.n:
            raise OpenAIError(400, "best_of > n cannot be streamed: the best samples are known only at the end",
                              param="best_of", code="invalid_value")

    @property
    def num_samples(self) -> int:
        """best_of samples per prompt (n unless best_of says more)."""
        return self.best_of or self.n

    @property
    def engine_logprobs(self) -> int | None:
        """The logprobs to ask the engine for: the client's, or 0 (the sampled token's alone)
        when best_of ranks samples by their cumulative logprob."""
        if self.logprobs is None and self.num_samples > self.n:
            return 0
        return self.logprobs

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


CHAT_TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})
"""Names chat_template_kwargs may not use: apply_chat_template's own arguments (transformers),
which the request sets through its own fields or which would change what the call returns."""


def check_template_flags(add_generation_prompt: bool, continue_final_message: bool,
                         template_kwargs: dict[str, Any] | None) -> None:
    """The chat template's options of a request (chat, /tokenize), as vLLM checks them."""
    if add_generation_prompt and continue_final_message:
        raise OpenAIError(400, "continue_final_message and add_generation_prompt cannot both be true (set "
                               "add_generation_prompt to false to continue the last message)",
                          param="continue_final_message", code="invalid_value")
    reserved = sorted(CHAT_TEMPLATE_RESERVED & set(template_kwargs or {}))
    if reserved:
        raise OpenAIError(400, f"chat_template_kwargs may not set {', '.join(reserved)} (the request's own fields "
                               f"do)", param="chat_template_kwargs", code="invalid_value")


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, field(bounds.LOGPROBS)] | None = None
    max_completion_tokens: Annotated[int, field(bounds.MAX_TOKENS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # extensions (vLLM's names)
    echo: bool = False
    """The reply starts with the last message's content if that message is the assistant's."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """The model continues the last message (an assistant's prefix) instead of starting a new one."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables for the chat template (e.g. {"enable_thinking": false})."""

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools or self.tool_choice not in (None, "none"):
            raise OpenAIError(400, "tools are not supported by this server", param="tools",
                              code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        check_template_flags(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)

    def echo_text(self) -> str:
        """What the reply starts with (vLLM's echo): the last message's content if it is the
        assistant's, else nothing."""
        last = self.messages[-1]
        return last.as_template_input()["content"] if self.echo and last.role == "assistant" else ""

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


def best_of(results: list[Completion], per_prompt: int, n: int) -> list[Completion]:
    """vLLM's best_of: of each prompt's `per_prompt` samples (consecutive in `results`), the
    `n` whose sampled tokens have the highest cumulative logprob, best first."""
    if per_prompt == n:
        return results
    chosen = []
    for start in range(0, len(results), per_prompt):
        group = results[start:start + per_prompt]
        chosen += sorted(group, key=lambda c: sum(lp.logprob for lp in c.logprobs or []), reverse=True)[:n]
    return chosen


@dataclass(frozen=True)
class ChoiceContext:
    """What the choices of one response carry besides the engine's output. Choice i answers
    prompt i // n."""

    prompt_ids: list[list[int]]
    n: int = 1
    echo: list[str] | None = None
    """Each prompt's text that precedes its choices' output (echo); None: nothing."""
    token_ids: bool = False
    """vLLM's return_token_ids: the prompt's token ids and each choice's."""

    @property
    def num_choices(self) -> int:
        return len(self.prompt_ids) * self.n

    def echo_text(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def prompt_token_ids(self, index: int) -> list[int]:
        return self.prompt_ids[index // self.n]


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

    def __init__(self, logprobs: LogprobFormatter | None, context: ChoiceContext | None = None):
        self.logprobs = logprobs
        self.context = context or ChoiceContext([])
        self._offsets: dict[int, int] = {}
        self._started: set[int] = set()

    def _logprobs(self, index: int, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if self.logprobs is None or logprobs is None:
            return None
        out, self._offsets[index] = self.logprobs.completion(logprobs, self._offsets.get(index, 0))
        return out

    def choice(self, index: int, c: Completion) -> dict[str, Any]:
        out = {"index": index, "text": self.context.echo_text(index) + c.text,
               "logprobs": self._logprobs(index, c.logprobs or []), "finish_reason": c.finish_reason,
               "stop_reason": c.stop_reason}
        if self.context.token_ids:
            out |= {"token_ids": c.token_ids, "prompt_token_ids": self.context.prompt_token_ids(index)}
        return out

    def chunk_choice(self, index: int, d: Delta) -> dict[str, Any]:
        """The first chunk of a choice starts with the echoed prompt and carries the prompt's
        token ids (vLLM's shapes)."""
        first = index not in self._started
        self._started.add(index)
        echo = self.context.echo_text(index) if first else ""
        out = {"index": index, "text": echo + d.text, "logprobs": self._logprobs(index, d.logprobs or []),
               "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
        if self.context.token_ids:
            out["token_ids"] = d.token_ids
            if first:
                out["prompt_token_ids"] = self.context.prompt_token_ids(index)
        return out

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before the engine's first output: none."""
        return []

    def top_level(self) -> dict[str, Any]:
        """Fields of the whole response besides the header, choices and usage: none."""
        return {}


class ChatShapes:
    """Choices of /v1/chat/completions, whole or as stream chunks."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, logprobs: LogprobFormatter | None, context: ChoiceContext | None = None):
        self.logprobs = logprobs
        self.context = context or ChoiceContext([])

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        return None if self.logprobs is None or logprobs is None else self.logprobs.chat(logprobs)

    def choice(self, index: int, c: Completion) -> dict[str, Any]:
        out = {"index": index, "message": {"role": "assistant", "content": self.context.echo_text(index) + c.text},
               "logprobs": self._logprobs(c.logprobs or []), "finish_reason": c.finish_reason,
               "stop_reason": c.stop_reason}
        if self.context.token_ids:
            out["token_ids"] = c.token_ids
        return out

    def chunk_choice(self, index: int, d: Delta) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": d.text}
        out = {"index": index, "delta": delta, "logprobs": self._logprobs(d.logprobs or []),
               "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
        if self.context.token_ids:
            out["token_ids"] = d.token_ids
        return out

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before the engine's first output, as OpenAI and vLLM send them: each
        choice's first chunk names the role and nothing else (`content` ""; a client that
        reads the first chunk as the role's loses no text), with the prompt's token ids if
        asked; then, with echo, a chunk of the echoed text per choice."""
        chunks = []
        for i in range(self.context.num_choices):
            chunk: dict[str, Any] = {"choices": [self._bare(i, {"role": "assistant", "content": ""})]}
            if self.context.token_ids:
                chunk["prompt_token_ids"] = self.context.prompt_token_ids(i)
            chunks.append(chunk)
        for i in range(self.context.num_choices):
            if self.context.echo_text(i):
                chunks.append({"choices": [self._bare(i, {"content": self.context.echo_text(i)})]})
        return chunks

    @staticmethod
    def _bare(index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, "stop_reason": None}

    def top_level(self) -> dict[str, Any]:
        """Fields of the whole response besides the header, choices and usage: vLLM puts the
        prompt's token ids there (return_token_ids)."""
        return {"prompt_token_ids": self.context.prompt_ids[0]} if self.context.token_ids else {}
