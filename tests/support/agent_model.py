"""A fake model that follows an agent's conversation, for FakeVLLM.responder: what the compatibility suite
(tests/compat) serves framework agents with, in vLLM 0.32's shapes (the fake renders them).

    vllm.responder = agent_model.answer

Rules, applied to the request as vLLM receives it (OpenAI chat; the gateway converts Anthropic calls first):
- a named `tool_choice` calls that tool; `required` calls the first tool not yet called in the conversation (the
  output tool of pydantic-ai, say, once the weather tool has answered), else the first tool;
- with `tools` (auto) and no tool result yet, it calls the first tool;
- otherwise, under `response_format` `json_schema` (or `json_object`) it answers an instance of the schema, else text
  that quotes the last tool result, so an agent's final answer shows its tool really ran.
Arguments and JSON answers are instances built from the schema (`instance`): enum values first, "Paris" for a
string, 21 for an integer, true for a boolean, one item per array. Deterministic: the same request, the same answer.
"""

from __future__ import annotations

import json
from typing import Any

from tests.support.fake_vllm import Reply, ToolCall

CITY = "Paris"
WEATHER = "sunny, 21 C"


def instance(schema: Any, defs: dict[str, Any] | None = None) -> Any:
    """A small value valid for a JSON schema (the subset agent frameworks emit: objects, $ref/$defs, anyOf, enums)."""
    if not isinstance(schema, dict):
        return None
    defs = {**(defs or {}), **schema.get("$defs", {}), **schema.get("definitions", {})}
    if "$ref" in schema:
        return instance(defs.get(schema["$ref"].rsplit("/", 1)[-1], {}), defs)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = [o for o in schema.get(key, []) if isinstance(o, dict) and o.get("type") != "null"]
        if options:
            return instance(options[0], defs)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "object" or "properties" in schema:
        return {name: instance(sub, defs) for name, sub in schema.get("properties", {}).items()}
    if kind == "array":
        return [instance(schema.get("items", {}), defs)]
    if kind == "integer":
        return 21
    if kind == "number":
        return 21.5
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return CITY


def _tool_schema(tool: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    function = tool.get("function", {})
    return function.get("name", ""), function.get("parameters") or {}


def _called(messages: list[Any]) -> set[str]:
    names = set()
    for message in messages:
        for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
            names.add(call.get("function", {}).get("name"))
    return names


def _tool_results(messages: list[Any]) -> list[str]:
    out = []
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "tool":
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            out.append(str(content))
    return out


def answer(body: dict[str, Any]) -> Reply:
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    choice = body.get("tool_choice")
    results = _tool_results(messages)
    if tools and choice != "none":
        by_name = dict(_tool_schema(t) for t in tools)
        if isinstance(choice, dict):
            name = choice.get("function", {}).get("name", "")
            return Reply(content="", tool_calls=(ToolCall(name, instance(by_name.get(name, {}))),))
        if choice == "required" or not results:
            called = _called(messages)
            name = next((n for n in by_name if n not in called), next(iter(by_name)))
            return Reply(content="", tool_calls=(ToolCall(name, instance(by_name[name])),))
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        spec = response_format.get("json_schema") or {}
        return Reply(content=json.dumps(instance(spec.get("schema", {}))))
    if isinstance(response_format, dict) and response_format.get("type") == "json_object":
        return Reply(content=json.dumps({"city": CITY}))
    if results:
        return Reply(content=f"The tool said: {results[-1]}")
    return Reply(content=f"It is {WEATHER} in {CITY}.")
