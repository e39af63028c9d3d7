"""LlamaIndex as its docs write agents on an OpenAI-compatible server (`OpenAILike`, a chat model that calls
functions): a `FunctionAgent` with a tool, structured prediction with a pydantic model (a forced function call), and
a streamed chat."""

from __future__ import annotations

from common import QUESTION, SYSTEM, Weather, get_weather
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.openai_like import OpenAILike

PACKAGES = ("llama-index-core", "llama-index-llms-openai-like", "llama-index-llms-openai", "openai")


def _llm(t):
    return OpenAILike(model=t.model, api_base=t.openai_base, api_key="x", is_chat_model=True,
                      is_function_calling_model=True, context_window=1024, default_headers=t.headers, max_retries=0)


async def tools(t):
    agent = FunctionAgent(tools=[get_weather], llm=_llm(t), system_prompt=SYSTEM)
    return str(await agent.run(QUESTION))


async def structured(t):
    return (await _llm(t).astructured_predict(Weather, PromptTemplate(QUESTION))).model_dump()


async def stream(t):
    chunks = await _llm(t).astream_chat([ChatMessage(role="user", content=QUESTION)])
    return "".join([chunk.delta or "" async for chunk in chunks])


PATTERNS = {"tools": tools, "structured": structured, "stream": stream}
