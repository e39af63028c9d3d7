"""LangChain (`langchain-openai`, `langchain-anthropic`) and LangGraph as their docs write agents: a tool-calling
model in a loop, `with_structured_output(Model)` (its default method), streaming, LangGraph's prebuilt ReAct agent
(with a `response_format` too), and `ChatAnthropic.with_structured_output` on the Anthropic route."""

from __future__ import annotations

from common import QUESTION, SYSTEM, Weather
from common import get_weather as _get_weather
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

PACKAGES = ("langchain-openai", "langchain-core", "langgraph", "langchain-anthropic")


@tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return _get_weather(city)


def _llm(t):
    return ChatOpenAI(model=t.model, base_url=t.openai_base, api_key="x", default_headers=t.headers, max_retries=0)


async def tools(t):
    llm = _llm(t).bind_tools([get_weather])
    messages = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    for _ in range(4):
        reply = await llm.ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return reply.content
        for call in reply.tool_calls:
            messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    raise RuntimeError("no final answer after 4 turns")


async def structured(t):
    return (await _llm(t).with_structured_output(Weather).ainvoke(QUESTION)).model_dump()


async def stream(t):
    return "".join([chunk.content async for chunk in _llm(t).astream(QUESTION)])


async def langgraph_react(t):
    agent = create_react_agent(_llm(t), tools=[get_weather], prompt=SYSTEM)
    result = await agent.ainvoke({"messages": [("user", QUESTION)]})
    return result["messages"][-1].content


async def langgraph_react_structured(t):
    agent = create_react_agent(_llm(t), tools=[get_weather], prompt=SYSTEM, response_format=Weather)
    result = await agent.ainvoke({"messages": [("user", QUESTION)]})
    return result["structured_response"].model_dump()


async def langgraph_stream(t):
    agent = create_react_agent(_llm(t), tools=[get_weather], prompt=SYSTEM)
    last = None
    async for state in agent.astream({"messages": [("user", QUESTION)]}, stream_mode="values"):
        last = state
    return last["messages"][-1].content


async def anthropic_structured(t):
    llm = ChatAnthropic(model=t.model, base_url=t.base_url, api_key="x", default_headers=t.headers, max_retries=0,
                        max_tokens=256)
    return (await llm.with_structured_output(Weather).ainvoke(QUESTION)).model_dump()


PATTERNS = {"tools": tools, "structured": structured, "stream": stream, "langgraph_react": langgraph_react,
            "langgraph_react_structured": langgraph_react_structured, "langgraph_stream": langgraph_stream,
            "anthropic_structured": anthropic_structured}
