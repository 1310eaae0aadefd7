"""The anthropic client against meshserve's Messages API: an agent loop (the model asked to
use a tool, the tool run here, its result sent back, the model's answer), whole and
streamed, as coding agents written against Anthropic's API drive it. Run by
scripts/outside_clients.py with the client's own virtual environment:
python anthropic_checks.py URL MODEL."""

import anthropic
from common import MODEL, TOOL_ASK, URL, check, need, report

client = anthropic.Anthropic(base_url=URL.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300)
ADD = {"name": "add", "description": "Adds two integers.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
TOOLS = {"add": lambda a, b: a + b}
LIMITS = {"model": MODEL, "max_tokens": 128, "tools": [ADD], "extra_body": {"temperature": 0}}


def agent_loop(stream: bool, max_turns: int = 3):
    """Runs tools until the model answers in text; the first turn must call one (a 135M model
    rarely does unasked)."""
    messages = [{"role": "user", "content": TOOL_ASK}]
    ran = []
    for turn in range(max_turns):
        choice = {"type": "tool", "name": "add"} if turn == 0 else {"type": "auto"}
        if stream:
            with client.messages.stream(messages=messages, tool_choice=choice, **LIMITS) as s:
                reply = s.get_final_message()
        else:
            reply = client.messages.create(messages=messages, tool_choice=choice, **LIMITS)
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            need(ran, f"the first turn called no tool: {reply.content!r}")
            need(reply.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {reply.stop_reason}")
            return {"tools_run": ran, "answer": "".join(b.text for b in reply.content if b.type == "text")}
        need(reply.stop_reason == "tool_use", f"tool_use blocks with stop_reason {reply.stop_reason}")
        messages.append({"role": "assistant", "content": reply.content})
        results = []
        for use in uses:
            value = TOOLS[use.name](**use.input)
            ran.append((use.name, use.input, value))
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": str(value)})
        messages.append({"role": "user", "content": results})
    return {"tools_run": ran, "answer": None}


check("messages agent loop", "tools=[add], tool_choice tool then auto, tool_result turns", lambda: agent_loop(False))
check("messages agent loop streamed", "the same, each turn streamed", lambda: agent_loop(True))
report(["anthropic", "httpx", "pydantic"])
