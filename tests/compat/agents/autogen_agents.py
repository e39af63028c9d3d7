"""AutoGen AgentChat as its docs write an `AssistantAgent` on an OpenAI-compatible server (`model_info` given, since
the model is not an OpenAI one): tools with reflection, structured output (`output_content_type`), streaming."""

from __future__ import annotations

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.base import TaskResult
from autogen_ext.models.openai import OpenAIChatCompletionClient
from common import QUESTION, SYSTEM, Weather, get_weather

PACKAGES = ("autogen-agentchat", "autogen-ext", "openai")
MODEL_INFO = {"vision": False, "function_calling": True, "json_output": True, "structured_output": True,
              "family": "unknown"}


def _client(t):
    return OpenAIChatCompletionClient(model=t.model, base_url=t.openai_base, api_key="x", model_info=MODEL_INFO,
                                      default_headers=t.headers, max_retries=0)


async def _run(agent):
    try:
        return (await agent.run(task=QUESTION)).messages[-1]
    finally:
        await agent._model_client.close()


async def tools(t):
    agent = AssistantAgent("weather", model_client=_client(t), tools=[get_weather], system_message=SYSTEM,
                           reflect_on_tool_use=True)
    return (await _run(agent)).content


async def structured(t):
    agent = AssistantAgent("weather", model_client=_client(t), system_message=SYSTEM, output_content_type=Weather)
    return (await _run(agent)).content.model_dump()


async def stream(t):
    client = _client(t)
    agent = AssistantAgent("weather", model_client=client, tools=[get_weather], system_message=SYSTEM,
                           reflect_on_tool_use=True, model_client_stream=True)
    try:
        async for item in agent.run_stream(task=QUESTION):
            if isinstance(item, TaskResult):
                return item.messages[-1].content
    finally:
        await client.close()
    raise RuntimeError("the stream ended without a result")


PATTERNS = {"tools": tools, "structured": structured, "stream": stream}
