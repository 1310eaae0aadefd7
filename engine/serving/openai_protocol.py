"""OpenAI's HTTP API as meshserve serves it: the request models and errors of
/v1/completions and /v1/chat/completions (openai_shapes.py has the responses).

Requests are pydantic models that refuse unknown fields, as OpenAI's API does (a typo such
as `max_token` is a 400, not silently ignored). They check the types of the sampling fields,
not their bounds: those are SamplingParams' (comm/messages.py), enforced when a request's
parameters are built (`sampling_params`), whose 400 names the request's parameter.
Parameters meshserve cannot honour (suffix, beam search, ...) are a 400 naming the parameter
unless they are left at their no-op value. Extensions (vLLM's names): top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens,
include_stop_str_in_output, prompt_logprobs, return_token_ids, truncate_prompt_tokens,
cache_salt, structured_outputs and the older guided_json / guided_regex / guided_choice /
guided_grammar; on chat also echo, add_generation_prompt, continue_final_message,
chat_template_kwargs.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from meshserve.comm import messages as bounds
from meshserve.comm.messages import ErrorCode, SamplingParams
from meshserve.engine.admission import RequestError, check_params
from meshserve.engine.serving.tools import ToolRequestError, validate_tool_request

MAX_N = 128
"""Most samples (n x prompts) one HTTP request may ask for."""
DEFAULT_COMPLETION_TOKENS = 16
"""OpenAI's default max_tokens for /v1/completions (chat defaults to the rest of the context)."""
IGNORED_HEADER = "x-meshserve-ignored-fields"
"""Response header naming the request's fields this server ignored (comma-separated)."""


class OpenAIError(Exception):
    """An error response: status code and OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def renamed(self, names: dict[str, str]) -> OpenAIError:
        """This error in another API's words: its parameter (and the message's leading name)
        as `names` calls it (the Responses API's names for chat's)."""
        new = names.get(self.param or "")
        if new is None:
            return self
        message = new + self.message[len(self.param):] if self.message.startswith(self.param) else self.message
        return OpenAIError(self.status, message, self.type, new, self.code)


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


_MSGSPEC_ERROR = re.compile(r"(?P<reason>.*) - at `\$\.(?P<field>\w+)[^`]*`", re.S)


def bound_error(e: msgspec.ValidationError, names: dict[str, str]) -> OpenAIError:
    """A bound of SamplingParams broken, as OpenAI's 400 naming the request's parameter:
    `names` maps the SamplingParams fields a request sets under another name to that name."""
    m = _MSGSPEC_ERROR.fullmatch(str(e))
    if m is None:
        return OpenAIError(400, str(e), code="invalid_value")
    param = names.get(m["field"], m["field"])
    return OpenAIError(400, f"{param}: {m['reason']}", param=param, code="invalid_value")


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
    "logits_processors": None, "chat_template": None, "mirostat": 0, "n_probs": 0,
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


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Strict):
    """Fields common to completions and chat completions."""

    model: str | None = None
    # NOTE: the sampling fields carry types, not bounds: SamplingParams holds those (comm/messages.py)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, OpenAI's shape) -> bias added to its logit."""
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = None
    """-1 or 0: off; at most the vocabulary's size."""
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    priority: Annotated[int, Field(ge=-(1 << 31), lt=1 << 31)] = 0
    """Its rank under scheduler.policy priority (lower first, vLLM's extension)."""
    """Share cached KV blocks only with requests of the same salt."""
    repetition_penalty: float | None = None
    min_p: float | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    """The prompt's token ids and each choice's (vLLM 0.10's `prompt_token_ids`, `token_ids`)."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=bounds.INT32_MAX)] | None = None
    """Keep only the prompt's last k tokens; -1: the model's maximum context."""
    prompt_logprobs: int | None = None
    """Each prompt token's logprob and the top n (the first token has none)."""
    # structured outputs (structured_request.py turns them into one constraint)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The prompt logprobs to ask the engine for."""
        return self.prompt_logprobs

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

    def param_names(self) -> dict[str, str]:
        """The SamplingParams fields this request sets under names of its own, and those names."""
        return {}

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int) -> SamplingParams:
        """The engine's parameters of this request, built and checked once: against
        SamplingParams' bounds, its own and the model's (check_params); a 400 naming the
        request's parameter if one is broken. The samples' seeds: `sample_params`."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields = {"max_tokens": max_tokens, "min_tokens": self.min_tokens,
                  "top_k": 0 if self.top_k == -1 else self.top_k or 0, "seed": self.seed, "stop": stop,
                  "stop_token_ids": list(self.stop_token_ids or []), "ignore_eos": self.ignore_eos,
                  "logprobs": logprobs, "skip_special_tokens": self.skip_special_tokens,
                  "include_stop_str_in_output": self.include_stop_str_in_output, "logit_bias": self._logit_bias(),
                  "prompt_logprobs": self.engine_prompt_logprobs}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        try:
            params = msgspec.convert(fields, SamplingParams)
            check_params(params, vocab_size)
        except msgspec.ValidationError as e:
            raise bound_error(e, self.param_names()) from None
        except RequestError as e:
            raise engine_error(e.code, e.message, self.param_names().get(e.param, e.param)) from None
        return params

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


def sample_params(params: SamplingParams, num_samples: int) -> list[SamplingParams]:
    """One request's parameters for each of its samples. NOTE: sample j gets seed + j: the same
    seed for all would make the samples identical. The seeds stay within SEED's bound, so the
    copies need no second check."""
    if params.seed is None:
        return [params] * num_samples
    return [msgspec.structs.replace(params, seed=(params.seed + j) % (1 << 63)) for j in range(num_samples)]


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt | None = None
    """Decoded and bounded by request_body.parse_body, which fills it in after validating the
    other fields: a pydantic union over a million token ids would hold the event loop."""
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    def check_supported(self) -> None:
        super().check_supported()
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

    def max_new_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_COMPLETION_TOKENS

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The prompt logprobs to ask the engine for: the client's, or, with echo and
        logprobs, as many as the echoed prompt's legacy logprobs show (OpenAI's shape)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

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
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant's calls (OpenAI's {"id", "type": "function", "function": {"name", "arguments"}})."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])

    def as_template_input(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text}

    def as_tool_input(self) -> dict[str, Any]:
        """The message as engine/serving/tools renders it: its calls and the call it answers kept."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        for name in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


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
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    """Accepted; a forced call (tool_choice required or named) is one call."""
    # extensions (vLLM's names)
    echo: bool = False
    """The reply starts with the last message's content if that message is the assistant's."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """The model continues the last message (an assistant's prefix) instead of starting a new one."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables for the chat template (e.g. {"enable_thinking": false})."""
    thinking_token_budget: Annotated[int, Field(ge=1)] | None = None
    """The most tokens the reply's reasoning may take before `</think>` is forced (needs a
    reasoning parser)."""

    def check_supported(self) -> None:
        super().check_supported()
        try:
            validate_tool_request(self.tools, self.tool_choice)
        except ToolRequestError as e:
            raise OpenAIError(400, str(e), param=e.param, code="invalid_value") from None
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        check_template_flags(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)

    def echo_text(self) -> str:
        """What the reply starts with (vLLM's echo): the last message's content if it is the
        assistant's, else nothing."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == "assistant" else ""

    @property
    def uses_tools(self) -> bool:
        """Whether the reply is read for tool calls (tools given and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self, prompt_tokens: int, max_model_len: int) -> int:
        """max_completion_tokens, else max_tokens, else the rest of the context."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else max(1, max_model_len - prompt_tokens)

    def param_names(self) -> dict[str, str]:
        max_tokens = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return {"max_tokens": max_tokens, "logprobs": "top_logprobs"}
