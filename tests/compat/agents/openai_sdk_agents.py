"""The `openai` SDK as its README writes agents: chat completions, a tool loop, `parse` with a pydantic model
(`response_format` json_schema), greedy decoding, and a streamed answer."""

from __future__ import annotations

import json

from common import QUESTION, SYSTEM, WEATHER_PARAMETERS, Weather, get_weather
from openai import AsyncOpenAI

PACKAGES = ("openai",)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER_PARAMETERS}}]


def _client(t):
    return AsyncOpenAI(base_url=t.openai_base, api_key="x", default_headers=t.headers, max_retries=0)


async def greedy(t):
    out = await _client(t).chat.completions.create(
        model=t.model, temperature=0, messages=[{"role": "user", "content": QUESTION}])
    return out.choices[0].message.content


async def json_schema(t):
    out = await _client(t).chat.completions.parse(
        model=t.model, response_format=Weather, messages=[{"role": "user", "content": QUESTION}])
    return out.choices[0].message.parsed.model_dump()


async def tools(t):
    client = _client(t)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for _ in range(4):
        out = await client.chat.completions.create(model=t.model, messages=messages, tools=TOOLS)
        message = out.choices[0].message
        if not message.tool_calls:
            return message.content
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = get_weather(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    raise RuntimeError("no final answer after 4 turns")


async def tool_required(t):
    out = await _client(t).chat.completions.create(
        model=t.model, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, tool_choice="required")
    call = out.choices[0].message.tool_calls[0]
    return {"tool": call.function.name, "arguments": json.loads(call.function.arguments)}


async def stream(t):
    chunks = await _client(t).chat.completions.create(
        model=t.model, messages=[{"role": "user", "content": QUESTION}], stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


PATTERNS = {"greedy": greedy, "json_schema": json_schema, "tools": tools, "tool_required": tool_required,
            "stream": stream}
