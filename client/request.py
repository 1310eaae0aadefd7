"""Building the GenerateRequest both clients send, checked on the client: a misspelt or
mistyped keyword fails at the call, named as the caller wrote it."""

from __future__ import annotations

import difflib
import re
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from meshserve.comm.messages import GenerateRequest, SamplingParams, StructuredOutputs

PARAMS = (*SamplingParams.__struct_fields__, "cache_salt", "structured_outputs", "lora", "priority")
"""The keywords `generate` takes beyond the prompt: SamplingParams' fields (max_tokens,
temperature, top_p, top_k, seed, stop, ...), cache_salt (the request shares cached KV blocks
only with requests of the same salt), structured_outputs (a StructuredOutputs, or a dict
of its fields: json, regex, choice, grammar or json_object), lora (the name of the LoRA
adapter to run with) and priority (an integer, lower first, on a server started with
scheduler.policy=priority)."""

_PATH = re.compile(r" - at `\$\.(\w+)[^`]*`$")


def make_request(caller: str, prompt: str | Sequence[int], *, request_id: str | None, stream: bool,
                 params: dict[str, Any]) -> GenerateRequest:
    """`caller`: the method the user called (for the error messages), e.g. "Client.generate"."""
    unknown = [k for k in params if k not in PARAMS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], PARAMS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; it takes {', '.join(PARAMS)}"
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}{hint}")
    params = {k: v for k, v in params.items() if v is not None}  # None: the default, as in the HTTP API
    salt = params.pop("cache_salt", None)
    if salt is not None and not (isinstance(salt, str) and 1 <= len(salt) <= 256):
        raise ValueError(f"{caller}(): cache_salt: a string of 1 to 256 characters, got {salt!r:.80}")
    lora = params.pop("lora", None)
    if lora is not None and not (isinstance(lora, str) and 1 <= len(lora) <= 128):
        raise ValueError(f"{caller}(): lora: an adapter's name, a string of 1 to 128 characters, got {lora!r:.80}")
    priority = params.pop("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or not -(1 << 31) <= priority < 1 << 31:
        raise ValueError(f"{caller}(): priority: an integer (32-bit), got {priority!r:.80}")
    structured = params.pop("structured_outputs", None)
    if isinstance(structured, dict):
        try:
            structured = msgspec.convert(structured, StructuredOutputs)
        except msgspec.ValidationError as e:
            raise ValueError(f"{caller}(): structured_outputs: {e}") from None
    elif structured is not None and not isinstance(structured, StructuredOutputs):
        raise TypeError(f"{caller}(): structured_outputs is a StructuredOutputs or a dict, "
                        f"got {type(structured).__name__}")
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    try:
        sampling = msgspec.convert(params, SamplingParams)
    except msgspec.ValidationError as e:
        m = _PATH.search(str(e))
        raise ValueError(f"{caller}(): {m.group(1) + ': ' if m else ''}{_PATH.sub('', str(e))}") from None
    rid = request_id or uuid.uuid4().hex
    if isinstance(prompt, str):
        return GenerateRequest(rid, prompt=prompt, params=sampling, stream=stream, cache_salt=salt,
                               structured_outputs=structured, lora=lora, priority=priority)
    if not isinstance(prompt, Sequence) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise TypeError(f"{caller}(): the prompt is a string or a sequence of token ids (ints), "
                        f"got {type(prompt).__name__}")
    return GenerateRequest(rid, prompt_token_ids=list(prompt), params=sampling, stream=stream, cache_salt=salt,
                           structured_outputs=structured, lora=lora, priority=priority)
