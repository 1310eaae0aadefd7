"""OpenAI tool calling, the model-side pieces: which syntax the model writes, the prompt that
tells it about the tools, the constraint that forces a call, and reading calls back out of
its text, whole or streamed. Pure Python; the chat endpoint wires it in.

One chat request, in order:

    validate_tool_request(req.tools, req.tool_choice)       # ToolRequestError(.param) -> 400
    fmt = tool_format_for(template_source)                 # once per model: HERMES | LLAMA3_JSON
    msgs, kwargs = render_messages(messages, req.tools, template_source, fmt)
    text = hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    constraint = forced_call(req.tools, req.tool_choice, fmt)  # None, or ToolConstraint(prefix, schema, suffix)
        # -> a grammar: literal prefix, then JSON matching schema, then literal suffix

    # non-streaming: one choice's text
    msg = fmt.parse(text)            # ParsedMessage(content: str | None, tool_calls: [OpenAI call dicts])
    # streaming: one ToolCallStream per choice
    stream = fmt.stream()
    for delta_text in ...: deltas = stream.feed(delta_text)   # list of chunk `delta` dicts
    deltas = stream.finish()                                   # after the last token
    # finish_reason "tool_calls" when msg.tool_calls / stream.num_calls > 0

Signatures:

    tool_format_for(chat_template: str | None) -> ToolFormat
    ToolFormat.parse(text: str) -> ParsedMessage
    ToolFormat.stream() -> ToolCallStream   # .feed(str) -> list[dict], .finish() -> list[dict], .num_calls
    render_messages(messages: list[dict], tools: list[dict] | None, template_source: str | None,
                    fmt: ToolFormat) -> tuple[list[dict], dict]
    forced_call(tools: list[dict] | None, tool_choice, fmt: ToolFormat) -> ToolConstraint | None
    validate_tool_request(tools, tool_choice) -> None   # validate_tools / validate_tool_choice apart

A tool call dict is OpenAI's: {"id": "call_<24 hex>", "type": "function", "function":
{"name": str, "arguments": str (JSON text of an object)}}. Text that is not a well-formed
call stays content; `parse` and `stream` never raise, and joining a stream's deltas gives what
`parse` gives for the whole text (however the text was split). A call is sent as OpenAI
streams it: a first delta with its id and name once it is committed (call_reader.py), then
its arguments' text in deltas as the model writes them.

Files: formats.py (the two syntaxes), scanners.py (reading them incrementally),
call_reader.py (one call's JSON, and when it commits), json_prefix.py (the JSON check it
uses), message_shapes.py (OpenAI message and delta shapes), render.py (the prompt),
constraints.py (forced calls), validation.py (request checks).
"""

from .constraints import ToolConstraint, forced_call
from .formats import FORMATS, HERMES, LLAMA3_JSON, HermesFormat, Llama3JsonFormat, ToolFormat, tool_format_for
from .message_shapes import ParsedMessage, ToolCallStream
from .render import chat_template_source, render_messages, template_uses_tools
from .validation import ToolRequestError, validate_tool_choice, validate_tool_request, validate_tools

__all__ = [
    "FORMATS", "HERMES", "LLAMA3_JSON", "HermesFormat", "Llama3JsonFormat", "ParsedMessage", "ToolCallStream",
    "ToolConstraint", "ToolFormat", "ToolRequestError", "chat_template_source", "forced_call", "render_messages",
    "template_uses_tools",
    "tool_format_for", "validate_tool_choice", "validate_tool_request", "validate_tools",
]
