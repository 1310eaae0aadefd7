"""The constraint that makes a model call a tool when the request says it must
(`tool_choice` "required" or a named function): a fixed prefix, a JSON schema, a fixed
suffix, which the grammar compiler (engine/structured.py) turns into a token mask.

Invariant: for any JSON text J that matches `schema`, `fmt.parse(prefix + J + suffix)` is
exactly one tool call, with no content, whose name is one of the allowed functions and whose
arguments match that function's `parameters`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .formats import ToolFormat
from .validation import forced_function, validate_tool_request

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""A function declared without parameters takes an empty object (as OpenAI reads it)."""


@dataclass(frozen=True)
class ToolConstraint:
    prefix: str
    schema: dict[str, Any]
    suffix: str


def forced_call(tools: list[dict[str, Any]] | None, tool_choice: Any, fmt: ToolFormat) -> ToolConstraint | None:
    """None when the model may answer freely ("none", "auto", no tool_choice); else the
    constraint for one call of the named function, or of any tool for "required" (an anyOf
    over the tools, each fixing its name with `const`). Raises ToolRequestError on an
    invalid pair."""
    validate_tool_request(tools, tool_choice)
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    name = forced_function(tool_choice)
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    several = len(functions) > 1
    schemas = []
    for i, function in enumerate(functions):
        at = (f"/anyOf/{i}" if several else "") + f"/properties/{fmt.arguments_key}"
        schemas.append(fmt.call_schema(function["name"], arguments_schema(function.get("parameters"), at)))
    return ToolConstraint(fmt.forced_prefix, {"anyOf": schemas} if several else schemas[0], fmt.forced_suffix)


def arguments_schema(parameters: dict[str, Any] | None, at: str) -> dict[str, Any]:
    """A function's `parameters` as the schema of its arguments placed at JSON pointer `at`
    inside the call's schema: typed "object" (a schema without "type" would let a string
    through, which no call can carry), and with its local `$ref`s rebased onto `at`.

    NOTE: rebasing keeps the tool's own `$defs` where they are; hoisting them to the root
    would need renaming when two tools define the same name."""
    schema = dict(parameters or EMPTY_PARAMETERS)
    schema.setdefault("type", "object")
    return _rebase_refs(schema, at)


def _rebase_refs(node: Any, at: str) -> Any:
    """A copy of `node` in which every "$ref" to a JSON pointer in this document ("#",
    "#/...") points under `at`."""
    if isinstance(node, list):
        return [_rebase_refs(v, at) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + at + value[1:]
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value  # data, not schema: a "$ref" key inside stays as written
        else:
            out[key] = _rebase_refs(value, at)
    return out
