"""pydantic-ai as its docs write agents: tools, `Agent(output_type=Model)` (its default tool output: a forced call of
the `final_result` tool), a streamed run, and the same agent on the Anthropic route (`AnthropicModel`)."""

from __future__ import annotations

from anthropic import AsyncAnthropic
from common import QUESTION, SYSTEM, Weather, get_weather
from openai import AsyncOpenAI
from pydantic_ai import Agent
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider

PACKAGES = ("pydantic-ai-slim", "openai", "anthropic")


def _model(t):
    client = AsyncOpenAI(base_url=t.openai_base, api_key="x", default_headers=t.headers, max_retries=0)
    return OpenAIChatModel(t.model, provider=OpenAIProvider(openai_client=client))


def _anthropic(t):
    client = AsyncAnthropic(base_url=t.base_url, api_key="x", default_headers=t.headers, max_retries=0)
    return AnthropicModel(t.model, provider=AnthropicProvider(anthropic_client=client))


async def tools(t):
    agent = Agent(_model(t), instructions=SYSTEM, tools=[get_weather])
    return (await agent.run(QUESTION)).output


async def output_type(t):
    agent = Agent(_model(t), instructions=SYSTEM, output_type=Weather)
    return (await agent.run(QUESTION)).output.model_dump()


async def tools_output_type(t):
    agent = Agent(_model(t), instructions=SYSTEM, tools=[get_weather], output_type=Weather)
    return (await agent.run(QUESTION)).output.model_dump()


async def stream(t):
    agent = Agent(_model(t), instructions=SYSTEM, tools=[get_weather])
    async with agent.run_stream(QUESTION) as result:
        return await result.get_output()


async def anthropic_output_type(t):
    agent = Agent(_anthropic(t), instructions=SYSTEM, tools=[get_weather], output_type=Weather,
                  model_settings={"max_tokens": 256})
    return (await agent.run(QUESTION)).output.model_dump()


PATTERNS = {"tools": tools, "output_type": output_type, "tools_output_type": tools_output_type, "stream": stream,
            "anthropic_output_type": anthropic_output_type}
