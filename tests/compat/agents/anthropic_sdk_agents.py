"""The `anthropic` SDK as its docs write tool use, against the gateway's Anthropic route (`POST /v1/messages`): a tool
loop, a forced tool call (`tool_choice` any), and a streamed tool loop. (The SDK's `messages.create` no longer takes
`temperature`.)"""

from __future__ import annotations

from anthropic import AsyncAnthropic
from common import QUESTION, WEATHER_PARAMETERS, get_weather

PACKAGES = ("anthropic",)
TOOLS = [{"name": "get_weather", "description": "Current weather of a city", "input_schema": WEATHER_PARAMETERS}]


def _client(t):
    return AsyncAnthropic(base_url=t.base_url, api_key="x", default_headers=t.headers, max_retries=0)


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


async def _loop(t, create):
    messages = [{"role": "user", "content": QUESTION}]
    for _ in range(4):
        message = await create(messages)
        if message.stop_reason != "tool_use":
            return _text(message)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": get_weather(**b.input)}
            for b in message.content if b.type == "tool_use"]})
    raise RuntimeError("no final answer after 4 turns")


async def tools(t):
    client = _client(t)
    return await _loop(t, lambda messages: client.messages.create(
        model=t.model, max_tokens=256, tools=TOOLS, messages=messages))


async def stream_tools(t):
    client = _client(t)

    async def create(messages):
        async with client.messages.stream(model=t.model, max_tokens=256, tools=TOOLS, messages=messages) as s:
            return await s.get_final_message()

    return await _loop(t, create)


async def tool_any(t):
    message = await _client(t).messages.create(
        model=t.model, max_tokens=256, tools=TOOLS, tool_choice={"type": "any"},
        messages=[{"role": "user", "content": QUESTION}])
    block = next(b for b in message.content if b.type == "tool_use")
    return {"tool": block.name, "input": block.input}


PATTERNS = {"tools": tools, "stream_tools": stream_tools, "tool_any": tool_any}
