"""The OpenAI Agents SDK as its docs write agents for another provider (an `AsyncOpenAI` client on the chat
completions API, tracing off): a function tool (strict by default), `Agent(output_type=Model)`, and a streamed run."""

from __future__ import annotations

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from common import QUESTION, SYSTEM, Forecast, Weather
from common import get_weather as _get_weather
from openai import AsyncOpenAI

PACKAGES = ("openai-agents", "openai")
set_tracing_disabled(True)  # no tracing exporter: nothing leaves the machine


@function_tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return _get_weather(city)


def _model(t):
    client = AsyncOpenAI(base_url=t.openai_base, api_key="x", default_headers=t.headers, max_retries=0)
    return OpenAIChatCompletionsModel(model=t.model, openai_client=client)


async def tools(t):
    agent = Agent(name="weather", instructions=SYSTEM, model=_model(t), tools=[get_weather])
    return (await Runner.run(agent, QUESTION)).final_output


async def output_type(t):
    agent = Agent(name="weather", instructions=SYSTEM, model=_model(t), output_type=Weather)
    return (await Runner.run(agent, QUESTION)).final_output.model_dump()


async def stream_tools(t):
    agent = Agent(name="weather", instructions=SYSTEM, model=_model(t), tools=[get_weather])
    result = Runner.run_streamed(agent, QUESTION)
    async for _ in result.stream_events():
        pass
    return result.final_output


async def output_type_seeded(t):
    """`output_type` with a seed (so a real sampler draws the same tokens outside and inside a Task) and a budget."""
    settings = ModelSettings(max_tokens=400, extra_args={"seed": 11})
    agent = Agent(name="weather", instructions=SYSTEM, model=_model(t), output_type=Forecast, model_settings=settings)
    return (await Runner.run(agent, QUESTION)).final_output.model_dump()


PATTERNS = {"tools": tools, "output_type": output_type, "stream_tools": stream_tools,
            "output_type_seeded": output_type_seeded}
