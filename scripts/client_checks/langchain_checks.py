"""langchain-openai and LangGraph against meshserve: structured outputs and tool calling. Run by
scripts/outside_clients.py with the client's own virtual environment: python langchain_checks.py URL MODEL."""

import functools
import operator

from common import ASK, MODEL, TOOL_ASK, URL, Sum, check, need, report
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

chat = ChatOpenAI(base_url=URL, api_key="unused", model=MODEL, max_tokens=128, temperature=0, max_retries=0,
                  timeout=300)
RAN = []


@tool
def add(a: int, b: int) -> int:
    """Adds two integers."""
    RAN.append((a, b))
    return a + b


def structured(**method):
    def go():
        out = chat.with_structured_output(Sum, **method).invoke(ASK)
        need(isinstance(out, Sum), f"got {out!r}")
        return out
    return go


def called(tool_choice, stream=False, strict=None):
    """The model's reply to TOOL_ASK with `add` bound; it must carry a tool call."""
    bound = chat.bind_tools([add], tool_choice=tool_choice, strict=strict)
    msg = functools.reduce(operator.add, bound.stream(TOOL_ASK)) if stream else bound.invoke(TOOL_ASK)
    need(msg.tool_calls, f"no tool call: content={msg.content!r}, invalid={msg.invalid_tool_calls!r}")
    return msg


def executed(tool_choice, stream=False, strict=None):
    """langchain runs the call it parsed; the tool must have run."""
    def go():
        before = len(RAN)
        result = add.invoke(called(tool_choice, stream, strict).tool_calls[0])
        need(len(RAN) > before, "the tool did not run")
        return result
    return go


def tool_result_turn():
    msg = called("add", strict=True)
    answer = chat.bind_tools([add], tool_choice="none").invoke([HumanMessage(TOOL_ASK), msg,
                                                                 add.invoke(msg.tool_calls[0])])
    need(answer.content and not answer.tool_calls, f"no answer after the tool result: {answer!r}")
    return answer.content


def react_agent():
    """LangGraph's prebuilt loop; the model function forces the first call, then lets it answer."""
    from langgraph.prebuilt import create_react_agent

    def model(state, runtime):
        done = any(isinstance(m, ToolMessage) for m in state["messages"])
        return chat.bind_tools([add], tool_choice=None if done else "any", strict=True)

    before = len(RAN)
    state = create_react_agent(model, [add]).invoke({"messages": [HumanMessage(TOOL_ASK)]},
                                                    {"recursion_limit": 8})
    last = state["messages"][-1]
    need(len(RAN) > before, "no tool executed")
    need(isinstance(last, AIMessage) and last.content and not last.tool_calls, f"no final answer: {last!r}")
    return last.content


check("with_structured_output(Sum)", "default method (json_schema in langchain-openai >= 0.3): "
      "response_format json_schema", structured())
check("with_structured_output(Sum, method=json_schema)", "response_format json_schema, strict from langchain",
      structured(method="json_schema"))
check("with_structured_output(Sum, method=function_calling)", "tools=[Sum] (not strict) with tool_choice naming "
      "it", structured(method="function_calling"))
check("with_structured_output(Sum, method=function_calling, strict)", "tools=[Sum] (strict) with tool_choice "
      "naming it", structured(method="function_calling", strict=True))
check("with_structured_output(Sum, method=json_mode)", "response_format={'type': 'json_object'}",
      structured(method="json_mode"))
check("bind_tools tool_choice=add, executed", "tools=[add] (langchain's default: not strict), tool_choice named "
      "'add'; add.invoke(tool_call) runs", executed("add"))
check("bind_tools tool_choice=add strict, executed", "tools=[add] (strict), tool_choice named 'add'; "
      "add.invoke(tool_call) runs", executed("add", strict=True))
check("bind_tools tool_choice=any strict, executed", "tools=[add] (strict), tool_choice='required'; "
      "add.invoke(tool_call) runs", executed("any", strict=True))
check("bind_tools streamed strict, executed", "stream=True, tools=[add] (strict), tool_choice named 'add'; the "
      "merged chunks carry the call and it runs", executed("add", stream=True, strict=True))
check("tool result sent back", "user, assistant tool_calls, role tool; tool_choice='none'; an answer comes back",
      tool_result_turn)
check("langgraph create_react_agent", "tools=[add] (strict), tool_choice='required' until a tool ran, then "
      "auto; recursion_limit 8", react_agent)
report(["langchain-openai", "langchain-core", "langgraph", "openai", "pydantic"])
