"""The OpenAI Agents SDK against meshserve: structured outputs and tool calling. Run by
scripts/outside_clients.py with the client's own virtual environment: python agents_checks.py URL MODEL."""

import asyncio

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from common import ASK, MODEL, TOOL_ASK, URL, Sum, check, need, report
from openai import AsyncOpenAI

set_tracing_disabled(True)
RAN = []


@function_tool
def add(a: int, b: int) -> int:
    """Adds two integers."""
    RAN.append((a, b))
    return a + b


def agent(model_class, **kwargs):
    """An agent on meshserve; a client per run, as each run gets an event loop of its own."""
    client = AsyncOpenAI(base_url=URL, api_key="unused", max_retries=0, timeout=300)
    return Agent(name="calculator", instructions="Use the add tool, then state the total.",
                 model=model_class(model=MODEL, openai_client=client), **kwargs)


async def run(model_class, stream):
    """The SDK's loop: tool_choice required on the first turn (the SDK resets it after a call)."""
    calculator = agent(model_class, tools=[add],
                       model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0))
    if not stream:
        return await Runner.run(calculator, TOOL_ASK, max_turns=4)
    result = Runner.run_streamed(calculator, TOOL_ASK, max_turns=4)
    async for _ in result.stream_events():
        pass
    return result


def tool_loop(model_class, stream=False):
    def go():
        before = len(RAN)
        result = asyncio.run(run(model_class, stream))
        need(len(RAN) > before, "no tool executed")
        need(result.final_output, f"no final answer: {result.final_output!r}")
        return {"tool_runs": RAN[before:], "final_output": result.final_output}
    return go


def structured_output():
    summer = agent(OpenAIChatCompletionsModel, output_type=Sum,
                   model_settings=ModelSettings(max_tokens=128, temperature=0))
    out = asyncio.run(Runner.run(summer, ASK, max_turns=2)).final_output
    need(isinstance(out, Sum), f"final_output is {out!r}")
    return out


check("chat completions agent, tool then answer", "OpenAIChatCompletionsModel, tools=[add] (strict), "
      "tool_choice='required' then reset; a role: tool turn follows", tool_loop(OpenAIChatCompletionsModel))
check("chat completions agent, streamed", "the same with stream=True (tool-call deltas)",
      tool_loop(OpenAIChatCompletionsModel, stream=True))
check("chat completions agent, output_type=Sum", "response_format json_schema (strict) from the SDK",
      structured_output)
check("responses agent, tool then answer", "OpenAIResponsesModel (POST /v1/responses), tools=[add], "
      "tool_choice='required' then reset", tool_loop(OpenAIResponsesModel))
report(["openai-agents", "openai", "pydantic"])
