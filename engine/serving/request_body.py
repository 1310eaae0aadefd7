"""Untrusted HTTP bodies -> request models, with every size bounded before it is parsed.

    req = parse_body(body, CompletionRequest, max_model_len)   # OpenAIError(400) if bad

The body is first split into its top-level fields without building any value (msgspec's
Raw: no objects), so no field is parsed before its size is known:
- `prompt` is decoded by msgspec into the one shape its first bytes name (a string, strings,
  token ids, or lists of token ids), after its item counts were bounded from its bytes;
- `messages` is counted (a list of Raw) before pydantic sees it;
- every other field may take at most MAX_FIELD_BYTES.
Only then does pydantic validate the rest, in strict mode (types; the bounds of the sampling
fields are SamplingParams', checked when a request's parameters are built). A pydantic union
over a million token ids, or over millions of bad items, would hold the event loop for seconds
to minutes; this path stays short for any body of at most MAX_BODY_BYTES.
"""

from __future__ import annotations

import re
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta
from pydantic import BaseModel, ValidationError

from meshserve.comm.messages import TokenId
from meshserve.engine.serving.openai_protocol import MAX_N, OpenAIError

MAX_BODY_BYTES = 16 << 20
MAX_FIELD_BYTES = 64 << 10
"""Any field but `prompt` and `messages` (stop strings, stop_token_ids, logit_bias, ...)."""

Model = TypeVar("Model", bound=BaseModel)

_TokenIds = list[TokenId]
_Strings = Annotated[list[str], Meta(max_length=MAX_N)]
_TokenLists = Annotated[list[_TokenIds], Meta(max_length=MAX_N)]
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_UNION_TAG = re.compile(r"^(str|int|float|bool|[a-z-]+\[.*\])$")


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _json_error(e: Exception, data: bytes, where: str) -> OpenAIError:
    if isinstance(e, RecursionError):
        return _bad(f"{where} is nested too deeply")
    detail = str(e)
    if _SURROGATE_ESCAPE.search(data):
        detail += " (a \\uD800-\\uDFFF escape must be one half of a surrogate pair: strings must be valid Unicode)"
    return _bad(f"{where} is not valid JSON: {detail}")


def split_fields(body: bytes) -> dict[str, msgspec.Raw]:
    """The body's top-level fields, undecoded."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        raise _bad("the body must be a JSON object") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise _json_error(e, body, "the body") from None
    return fields


def decode_prompt(raw: bytes, max_model_len: int) -> str | list[str] | list[int] | list[list[int]]:
    """`prompt` of /v1/completions, decoded into the shape its first bytes name, with its item
    counts bounded from its bytes first (a comma or bracket count is a cheap upper bound)."""
    body = raw.lstrip()
    shape = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    try:
        if body[:1] == b'"':
            return msgspec.json.decode(body, type=str)
        if body[:1] != b"[":
            raise _bad(f"prompt must be {shape}", "prompt")
        first = body[1:].lstrip()[:1]
        if first == b"]":
            raise _bad("the prompt is empty", "prompt")
        if first == b'"':
            prompts = msgspec.json.decode(body, type=_Strings)
        elif first == b"[":
            if body.count(b"[") - 1 > MAX_N:
                raise _bad(f"prompt has more than {MAX_N} prompts", "prompt")
            if body.count(b",") >= MAX_N * max_model_len:
                raise _too_long(max_model_len)
            prompts = msgspec.json.decode(body, type=_TokenLists)
        elif first.isdigit() or first == b"-":
            if body.count(b",") >= max_model_len:
                raise _too_long(max_model_len)
            prompts = msgspec.json.decode(body, type=_TokenIds)
        else:
            raise _bad(f"prompt must be {shape}", "prompt")
    except msgspec.ValidationError as e:
        raise _bad(f"prompt: {_msgspec_detail(e)}", "prompt") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise _json_error(e, body, "prompt") from None
    if isinstance(prompts, list) and not prompts:
        raise _bad("the prompt is empty", "prompt")
    return prompts


def _too_long(max_model_len: int) -> OpenAIError:
    return _bad(f"the prompt has more token ids than the model's maximum context of {max_model_len} tokens",
                "prompt", "context_length_exceeded")


def _msgspec_detail(e: msgspec.ValidationError) -> str:
    text = str(e)
    if "<= 2147483647" in text or "< 2147483648" in text:
        return text + " (token ids are below 2**31)"
    return text


def count_messages(raw: bytes, max_messages: int) -> None:
    """`messages` of /v1/chat/completions: a list of at most `max_messages` items, counted
    without decoding them."""
    try:
        items = msgspec.json.decode(raw, type=list[msgspec.Raw])
    except msgspec.ValidationError:
        raise _bad("messages: Input should be a valid list", "messages") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise _json_error(e, raw, "messages") from None
    if len(items) > max_messages:
        raise _bad(f"messages has {len(items)} messages: more than fit the model's maximum context of "
                   f"{max_messages} tokens", "messages", "context_length_exceeded")


def parse_body(body: bytes, model: type[Model], max_model_len: int) -> Model:
    """Validate a request body against `model` (strict); OpenAIError(400) if it does not fit.
    `model` has a `prompt` field that parse_body fills (decode_prompt), or a `messages` field."""
    return parse_fields(split_fields(body), model, max_model_len)


def parse_fields(fields: dict[str, msgspec.Raw], model: type[Model], max_model_len: int) -> Model:
    """parse_body of a body already split into its fields (split_fields), for a caller that
    picks the model by the fields present."""
    prompt = None
    if "prompt" in model.model_fields:
        raw = fields.pop("prompt", None)
        if raw is None:
            raise _bad("prompt: Field required", "prompt")
        prompt = decode_prompt(bytes(raw), max_model_len)
    for name, raw in fields.items():
        if name == "messages":
            count_messages(bytes(raw), max_model_len)
        elif len(raw) > MAX_FIELD_BYTES:
            raise _bad(f"{name} has {len(raw)} bytes of JSON; the limit is {MAX_FIELD_BYTES}", name)
    rest = b"{" + b",".join(msgspec.json.encode(k) + b":" + bytes(v) for k, v in fields.items()) + b"}"
    try:
        req = model.model_validate_json(rest)
    except ValidationError as e:
        raise validation_error(e) from None
    if prompt is not None:
        req.prompt = prompt
    return req


def validation_error(exc: ValidationError) -> OpenAIError:
    """pydantic's first error as OpenAI's 400, naming the parameter."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return _bad(f"the body is not valid JSON: {detail}".rstrip(": "))
    # pydantic names each member of a union it tried (`str`, `list[int]`, ...): not for clients
    loc = [str(x) for x in first.get("loc", ()) if not _UNION_TAG.match(str(x))]
    param = loc[0] if loc else None
    more = f" ({len(errors) - 1} more errors)" if len(errors) > 1 else ""
    message = f"{'.'.join(loc)}: {first['msg']}{more}" if loc else f"{first['msg']}{more}"
    return _bad(message, param)
