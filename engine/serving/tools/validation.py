"""Checks of a request's `tools` and `tool_choice`, before anything is rendered or compiled.
Each failure is a ToolRequestError (a ValueError) that names the request parameter, for the
HTTP front to turn into a 400."""

from __future__ import annotations

import re
from typing import Any

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for function names."""

CHOICES = ("none", "auto", "required")


class ToolRequestError(ValueError):
    def __init__(self, param: str, message: str):
        """`param`: the request field at fault ("tools", "tool_choice" or "messages")."""
        super().__init__(message)
        self.param = param


def validate_tool_request(tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
    """Raises ToolRequestError unless `tools` and `tool_choice` make a valid pair."""
    validate_tools(tools)
    validate_tool_choice(tool_choice, tools)


def validate_tools(tools: list[dict[str, Any]] | None) -> None:
    """Each tool is {"type": "function", "function": {"name", "description"?, "parameters"?}}
    with a unique name and object-typed parameters."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ToolRequestError("tools", f"tools must be a list of tools, got {type(tools).__name__}")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = _check_tool(i, tool)
        if name in seen:
            raise ToolRequestError("tools", f"tools[{seen[name]}] and tools[{i}] both define a function "
                                            f"named `{name}`; function names must be unique")
        seen[name] = i


def _check_tool(i: int, tool: Any) -> str:
    """The function name of tools[i], after checking its shape."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolRequestError("tools", f'{where} must be {{"type": "function", "function": {{...}}}}')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolRequestError("tools", f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, "
                                        f"_ or -, got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolRequestError("tools", f"{where}.function.description must be a string")
    check_parameters(function.get("parameters"), f"{where}.function.parameters")
    return name


def check_parameters(parameters: Any, where: str) -> None:
    """A function's arguments are a JSON object, so its `parameters` must be a JSON schema
    of an object: a dict whose "type", if given, is "object" (None: no parameters)."""
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise ToolRequestError("tools", f"{where} must be a JSON schema object, got {type(parameters).__name__}")
    if parameters.get("type", "object") != "object":
        raise ToolRequestError("tools", f'{where} must be a JSON schema of an object ("type": "object"), '
                                        f'got "type": {parameters["type"]!r}')
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        raise ToolRequestError("tools", f"{where}.properties must be an object")


def forced_function(tool_choice: Any) -> str | None:
    """The function name a tool_choice of {"type": "function", "function": {"name"}} forces;
    None for the string choices."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def validate_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> None:
    """"none" and "auto" (or no tool_choice) go with any tools; "required" and a named
    function need tools, and the named one must be among them. `tools` is already valid."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    _check_choice_shape(tool_choice)
    name = forced_function(tool_choice)
    if not tools:
        label = "required" if name is None else f"function `{name}`"
        raise ToolRequestError("tool_choice", f"tool_choice {label} needs tools, and the request has none")
    names = [t["function"]["name"] for t in tools]
    if name is not None and name not in names:
        raise ToolRequestError("tool_choice", f"tool_choice names function `{name}`, which is not in tools "
                                              f"({', '.join(names)})")


def _check_choice_shape(tool_choice: Any) -> None:
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolRequestError("tool_choice", f"tool_choice must be one of {', '.join(CHOICES)} or "
                                                  f'{{"type": "function", "function": {{"name": ...}}}}, '
                                                  f"got {tool_choice!r}")
    elif not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
              and isinstance(tool_choice.get("function"), dict)
              and isinstance(tool_choice["function"].get("name"), str)):
        raise ToolRequestError("tool_choice", 'a tool_choice object must be {"type": "function", '
                                              '"function": {"name": ...}}')
