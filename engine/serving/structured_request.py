"""The structured-output fields of an HTTP request, as the one constraint it names:

- OpenAI's `response_format`: {"type": "json_object"} or {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}} ({"type": "text"}: none);
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": ...};
- vLLM's older names: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one may be given; the error names the parameters. engine/structured.py compiles it.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from meshserve.comm.messages import StructuredOutputs
from meshserve.engine.admission import RequestError
from meshserve.engine.serving.openai_protocol import OpenAIError
from meshserve.engine.structured import GrammarSpec, spec_from_message

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def _from_response_format(rf: Any) -> GrammarSpec | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec("json_object", param="response_format")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise _bad("response_format: type json_schema needs json_schema.schema (the JSON schema the output follows)",
                   "response_format")
    return GrammarSpec("json", json.dumps(rf.json_schema.schema_), param="response_format")


def _from_structured_outputs(raw: dict[str, Any] | None) -> GrammarSpec | None:
    if raw is None:
        return None
    try:
        so = msgspec.convert(raw, StructuredOutputs)
    except msgspec.ValidationError as e:
        raise _bad(f"structured_outputs: {e}", "structured_outputs") from None
    return _spec(so, "structured_outputs")


def _spec(so: StructuredOutputs, param: str) -> GrammarSpec:
    try:
        return spec_from_message(so, param)
    except RequestError as e:
        raise _bad(e.message, param) from None


def grammar_spec(req: Any) -> GrammarSpec | None:
    """The constraint `req` (a completions or chat request model) names, or None."""
    specs: list[GrammarSpec] = []
    for spec in (_from_response_format(req.response_format), _from_structured_outputs(req.structured_outputs)):
        if spec is not None:
            specs.append(spec)
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            try:
                so = msgspec.convert({kind: value}, StructuredOutputs)
            except msgspec.ValidationError as e:
                raise _bad(f"{name}: {e}", name) from None
            specs.append(_spec(so, name))
    if len(specs) > 1:
        names = ", ".join(s.param for s in specs)
        raise _bad(f"{names}: give at most one structured-output constraint", specs[1].param)
    return specs[0] if specs else None
