"""Anthropic ⇄ OpenAI conversion (§3.7): requests block by block, responses and streams through the official SDK."""

from __future__ import annotations

import copy
import json
from typing import Any

import anthropic
import orjson
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from openjiuwen.agent_evolving.agent_rl.gateway.proxy.anthropic import (
    AnthropicStreamWriter,
    anthropic_message_id,
    anthropic_to_openai_request,
    openai_to_anthropic_response,
    stop_reason,
)
from openjiuwen.agent_evolving.agent_rl.gateway.proxy.openai_shapes import StreamAggregator
from openjiuwen.agent_evolving.agent_rl.gateway.proxy.sse import DONE, SSEDecoder, encode_sse
from tests.conftest import FIXTURES, load_fixture

try:  # the official SDKs moved from httpx to httpx2; the mock transport must come from the SDK's own library
    import httpx2 as sdk_http
except ImportError:  # pragma: no cover - an SDK release still on httpx
    import httpx as sdk_http  # type: ignore[no-redef]

PRIVATE_KEYS = frozenset({"logprobs", "token_ids", "prompt_token_ids", "total_tokens", "routed_experts"})
STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)
PNG = "iVBORw0KGgo="


def keys_in(value: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(value, dict):
        found |= value.keys()
        for v in value.values():
            found |= keys_in(v)
    elif isinstance(value, list):
        for v in value:
            found |= keys_in(v)
    return found


def recorded_chunks() -> list[dict[str, Any]]:
    decoder = SSEDecoder(1 << 20)
    events = decoder.feed((FIXTURES / "chat_stream_response.sse").read_bytes()) + decoder.close()
    return [orjson.loads(e.data) for e in events if e.data != DONE]


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-7",
        "object": "chat.completion.chunk",
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "token_ids": [1]}],
    }


TOOL_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Let me "}),
    chunk({"content": "check."}),
    chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                           "function": {"name": "get_weather", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                           "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]}),
    chunk({}, finish_reason="tool_calls"),
    {"id": "chatcmpl-7", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21}},
]  # fmt: skip


def write_stream(chunks: list[dict[str, Any]], *, model: str = "claude-agent") -> list[tuple[str, dict[str, Any]]]:
    """What the gateway does: start, feed every chunk, finish with the aggregated finish reason and usage."""
    writer = AnthropicStreamWriter()
    aggregator = StreamAggregator()
    events = writer.start(anthropic_message_id(chunks[0]["id"]), model)
    for c in chunks:
        aggregator.feed(c)
        events += writer.feed(c)
    completion = aggregator.result()
    return events + writer.finish(completion["choices"][0]["finish_reason"], completion["usage"])


def sse_bytes(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(encode_sse(orjson.dumps(data), event=name) for name, data in events)


def sdk_client(handler: Any) -> anthropic.Anthropic:
    http = sdk_http.Client(transport=sdk_http.MockTransport(handler))
    return anthropic.Anthropic(api_key="test", base_url="http://gateway.test", http_client=http, max_retries=0)


def serving(body: bytes, content_type: str) -> Any:
    def handler(request: Any) -> Any:
        return sdk_http.Response(200, content=body, headers={"content-type": content_type})

    return handler


# ----------------------------------------------------------------------------------------------------- request


def test_minimal_request() -> None:
    body = load_fixture("messages_request.json")
    assert anthropic_to_openai_request(body) == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 6,
    }


def test_every_block_type_and_parameter_is_converted() -> None:
    body = {
        "model": "claude-agent",
        "system": [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Use tools.",
                                                                  "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this image, and the weather?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                {"type": "image", "source": {"type": "url", "url": "https://example.test/cat.png"}},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2",
                 "content": [{"type": "text", "text": "12:00"}, {"type": "text", "text": "CET"}]},
                {"type": "tool_result", "tool_use_id": "toolu_3"},
                {"type": "text", "text": "Thanks"},
            ]},
            {"role": "assistant", "content": "You're welcome."},
        ],
        "tools": [{"name": "get_weather", "description": "weather", "input_schema": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
            {"type": "custom", "name": "get_time", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop_sequences": ["END"], "stream": True,
        "metadata": {"user_id": "u1"},
    }  # fmt: skip
    before = copy.deepcopy(body)
    request = anthropic_to_openai_request(body)
    assert body == before
    assert request == {
        "model": "claude-agent",
        "messages": [
            {"role": "system", "content": "You are terse.\nUse tools."},
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this image, and the weather?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                {"type": "image_url", "image_url": {"url": "https://example.test/cat.png"}},
            ]},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'}},
                {"id": "toolu_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "12:00\nCET"},
            {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "You're welcome."},
        ],
        "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop": ["END"],
        "stream": True, "stream_options": {"include_usage": True},
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
        ],
        "tool_choice": "auto", "parallel_tool_calls": False,
    }  # fmt: skip


def test_what_shapes_generation_is_carried_over_as_vllm_does() -> None:
    """Issue 35: a strict tool keeps its strictness, structured output becomes `response_format`, enabled thinking's
    budget `thinking_token_budget` and the effort `reasoning_effort` (vLLM's Anthropic endpoint maps them so)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}, "strict": True}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    request = anthropic_to_openai_request(body)
    assert request["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                                  "strict": True}}]
    assert request["response_format"] == {"type": "json_schema", "json_schema": {"name": "json_schema",
                                                                                 "schema": schema}}
    assert (request["reasoning_effort"], request["thinking_token_budget"]) == ("low", 1024)
    disabled = anthropic_to_openai_request(dict(body, thinking={"type": "disabled"}, output_config={}))
    assert not {"thinking_token_budget", "response_format", "reasoning_effort"} & set(disabled)
    for bad, message in (({"output_config": {"format": {"type": "text"}}}, "output_config.format"),
                         ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
                         ({"tools": [{"name": "f", "input_schema": {}, "strict": "yes"}]}, r"tools\[0\]\.strict")):
        with pytest.raises(ValueError, match=message):
            anthropic_to_openai_request(dict(body, **bad))


def test_tool_only_assistant_message_has_null_content_and_tool_results_only_user_has_no_user_message() -> None:
    body = {"model": "m", "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": [1]}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok", "is_error": True}]},
    ]}  # fmt: skip
    messages = anthropic_to_openai_request(body)["messages"]
    assert messages[0]["content"] is None
    assert json.loads(messages[0]["tool_calls"][0]["function"]["arguments"]) == {"a": [1]}
    assert messages[1:] == [{"role": "tool", "tool_call_id": "t1", "content": "ok"}]


def test_text_blocks_and_empty_content() -> None:
    body = {"model": "m", "system": "", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "one"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": []},
    ], "stream": False}  # fmt: skip
    request = anthropic_to_openai_request(body)
    assert request["messages"] == [
        {"role": "user", "content": "one"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": ""},
    ]  # the empty system prompt is no system message
    assert request["stream"] is False and "stream_options" not in request


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    request = anthropic_to_openai_request({"model": "m", "messages": [], "tool_choice": choice})
    assert request["tool_choice"] == expected
    assert "parallel_tool_calls" not in request


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "request body must be a JSON object"),
        ({"model": "m"}, "messages must be a list"),
        ({"model": "m", "messages": "hi"}, "messages must be a list"),
        ({"messages": []}, "model must be a string"),
        ({"model": "m", "messages": [{"role": "system", "content": "x"}]}, r"messages\[0\]\.role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, r"messages\[0\]\.content must be"),
        ({"model": "m", "messages": [{"role": "user", "content": ["x"]}]}, r"messages\[0\]\.content\[0\] must be"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"text": "x"}]}]}, r"\.type must be a string"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         r"messages\[0\]\.content\[0\]: content block type 'document' is not supported in a user message"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                   "input": {}}]}]}, "'tool_use' is not supported"),
        ({"model": "m", "messages": [{"role": "assistant", "content": [{"type": "tool_result",
                                                                        "tool_use_id": "t"}]}]},
         "'tool_result' is not supported in an assistant message"),
        ({"model": "m", "messages": [{"role": "assistant", "content": [{"type": "image", "source": {}}]}]},
         "'image' is not supported in an assistant message"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
         r"\.text must be a string"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file",
                                                                                               "file_id": "f"}}]}]},
         "source.type 'file' is not supported"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
         "media_type and data"),
        ({"model": "m", "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                        "input": "{}"}]}]},
         r"\.input must be an object"),
        ({"model": "m", "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f",
                                                                        "input": {}}]}]}, r"\.id must be"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
         r"\.tool_use_id must be"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                   "content": [{"type": "image", "source": {}}]}]}]},
         "only text blocks are supported in a tool_result"),
        ({"model": "m", "messages": [], "system": [{"type": "image"}]}, "only text blocks are allowed in system"),
        ({"model": "m", "messages": [], "system": 3}, "system must be"),
        ({"model": "m", "messages": [], "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         r"tools\[0\]: tool type 'web_search_20250305' is not supported"),
        ({"model": "m", "messages": [], "tools": [{"name": "f"}]}, r"tools\[0\]\.input_schema must be an object"),
        ({"model": "m", "messages": [], "tools": {}}, "tools must be a list"),
        ({"model": "m", "messages": [], "tool_choice": "auto"}, "tool_choice must be an object"),
        ({"model": "m", "messages": [], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"model": "m", "messages": [], "tool_choice": {"type": "some"}}, "tool_choice.type 'some'"),
        ({"model": "m", "messages": [], "stop_sequences": "END"}, "stop_sequences must be a list of strings"),
        ({"model": "m", "messages": [], "stream": "yes"}, "stream must be a boolean"),
    ],
)  # fmt: skip
def test_invalid_requests_raise_value_error_with_a_precise_message(body: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        anthropic_to_openai_request(body)


def test_request_built_by_the_official_sdk_converts() -> None:
    seen: list[dict[str, Any]] = []
    answer = openai_to_anthropic_response(load_fixture("chat_response.json"), client_model="claude-agent")

    def handler(request: Any) -> Any:
        seen.append(anthropic_to_openai_request(orjson.loads(request.content)))
        return sdk_http.Response(200, content=orjson.dumps(answer), headers={"content-type": "application/json"})

    sdk_client(handler).messages.create(
        model="claude-agent",
        max_tokens=32,
        system="Be brief.",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": PNG}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        ],
        tools=[{"name": "get_weather", "description": "weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any"},
        stop_sequences=["END"],
    )  # fmt: skip
    (request,) = seen
    assert [m["role"] for m in request["messages"]] == ["system", "user", "assistant", "tool"]
    assert request["messages"][2]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                   "arguments": '{"city":"Paris"}'}
    assert request["tool_choice"] == "required"
    assert (request["max_tokens"], request["stop"]) == (32, ["END"])


# ---------------------------------------------------------------------------------------------------- response


def test_recorded_completion_as_an_anthropic_message() -> None:
    completion = load_fixture("chat_response.json")
    before = copy.deepcopy(completion)
    message = openai_to_anthropic_response(completion, client_model="claude-agent")
    assert completion == before
    assert message == {
        "id": "msg_chatcmpl-aa583cb9efe71bee",
        "type": "message",
        "role": "assistant",
        "model": "claude-agent",
        "content": [{"type": "text", "text": completion["choices"][0]["message"]["content"]}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {"input_tokens": 40, "output_tokens": 8},
    }
    assert keys_in(message).isdisjoint(PRIVATE_KEYS)
    # Everything vLLM's own /v1/messages answer carries, we carry too.
    assert load_fixture("messages_response.json").keys() <= message.keys()
    assert openai_to_anthropic_response(completion, client_model=None)["model"] == "tiny"


def tool_completion(arguments: str, content: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-9",
        "object": "chat.completion",
        "model": "tiny",
        "prompt_token_ids": [1, 2],
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content, "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
            ]},
            "finish_reason": "tool_calls",
            "token_ids": [3, 4],
            "logprobs": {"content": [{"token": "x", "logprob": -1.0}]},
        }],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
    }  # fmt: skip


def test_tool_calls_become_tool_use_blocks() -> None:
    message = openai_to_anthropic_response(tool_completion('{"city": "Paris"}', "Checking."), client_model=None)
    assert message["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert message["stop_reason"] == "tool_use"
    assert keys_in(message).isdisjoint(PRIVATE_KEYS)
    only_tools = openai_to_anthropic_response(tool_completion("{}", None), client_model=None)
    assert [b["type"] for b in only_tools["content"]] == ["tool_use"]


@pytest.mark.parametrize("arguments", ['{"city": "Par', "[1, 2]", "", "null"])
def test_unparseable_tool_arguments_give_an_empty_input(arguments: str) -> None:
    message = openai_to_anthropic_response(tool_completion(arguments), client_model=None)
    assert message["content"][-1]["input"] == {}


@pytest.mark.parametrize(
    ("finish", "expected"),
    [("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use"), ("abort", "end_turn"),
     (None, "end_turn")],
)  # fmt: skip
def test_stop_reason_mapping(finish: str | None, expected: str) -> None:
    assert stop_reason(finish) == expected


def test_completion_without_choices_is_rejected() -> None:
    with pytest.raises(ValueError, match="no choices"):
        openai_to_anthropic_response({"id": "x", "choices": []}, client_model=None)


def test_official_sdk_parses_the_converted_response() -> None:
    body = orjson.dumps(
        openai_to_anthropic_response(tool_completion('{"city": "Paris"}', "Checking."), client_model="claude-agent")
    )
    message = sdk_client(serving(body, "application/json")).messages.create(
        model="claude-agent", max_tokens=16, messages=[{"role": "user", "content": "weather?"}]
    )
    assert message.model == "claude-agent"
    assert message.content[0].type == "text" and message.content[0].text == "Checking."
    tool_use = message.content[1]
    assert tool_use.type == "tool_use" and (tool_use.id, tool_use.name) == ("call_a", "get_weather")
    assert tool_use.input == {"city": "Paris"}
    assert (message.stop_reason, message.usage.input_tokens, message.usage.output_tokens) == ("tool_use", 2, 2)
    assert not message.model_extra and not message.usage.model_extra


# ------------------------------------------------------------------------------------------------------ stream


def test_writer_on_the_recorded_stream_matches_vllm_native_event_sequence() -> None:
    events = write_stream(recorded_chunks(), model="tiny")
    decoder = SSEDecoder(1 << 20)
    native = [
        (e.event, orjson.loads(e.data))
        for e in decoder.feed((FIXTURES / "messages_stream_response.sse").read_bytes()) + decoder.close()
    ]

    def collapsed(names: list[str]) -> list[str]:  # the number of text deltas depends on the sampled text
        return [n for i, n in enumerate(names) if n != "content_block_delta" or names[i - 1] != n]

    assert collapsed([n for n, _ in events]) == collapsed([n for n, _ in native]) == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop",
    ]  # fmt: skip
    native_by_name = dict(native)
    for name, data in events:
        assert data["type"] == name
        assert keys_in(data) == keys_in(native_by_name[name])  # every field vLLM's own stream has, and no other
        STREAM_EVENT.validate_python(data)  # the SDK's own event models accept every payload
    assert events[0][1]["message"].keys() == native_by_name["message_start"]["message"].keys()
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"output_tokens": 6, "input_tokens": 11},
    }
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "".join(c["choices"][0]["delta"].get("content", "") for c in recorded_chunks() if c["choices"])
    assert all(keys_in(d).isdisjoint(PRIVATE_KEYS) for _, d in events)


def test_official_sdk_reassembles_a_text_stream() -> None:
    chunks = recorded_chunks()
    client = sdk_client(serving(sse_bytes(write_stream(chunks)), "text/event-stream"))
    with client.messages.stream(
        model="claude-agent", max_tokens=6, messages=[{"role": "user", "content": "hello world"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    expected = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == expected
    assert (final.id, final.model, final.stop_reason) == ("msg_chatcmpl-9299d34851db2286", "claude-agent", "max_tokens")
    assert final.usage.output_tokens == 6


def test_official_sdk_reassembles_text_and_tool_use_blocks() -> None:
    events = write_stream(TOOL_STREAM)
    boundaries = [(n, d["index"]) for n, d in events if n in ("content_block_start", "content_block_stop")]
    assert boundaries == [
        ("content_block_start", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_stop", 2),
    ]  # fmt: skip
    for _, data in events:
        STREAM_EVENT.validate_python(data)
    client = sdk_client(serving(sse_bytes(events), "text/event-stream"))
    with client.messages.stream(
        model="claude-agent", max_tokens=64, messages=[{"role": "user", "content": "weather?"}]
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert final.content[0].text == "Let me check."
    assert (final.content[1].id, final.content[1].name, final.content[1].input) == (
        "call_a", "get_weather", {"city": "Paris"}
    )  # fmt: skip
    assert (final.content[2].id, final.content[2].name, final.content[2].input) == (
        "call_b", "get_time", {"tz": "CET"}
    )  # fmt: skip
    assert (final.stop_reason, final.usage.output_tokens) == ("tool_use", 9)

    raw = list(sdk_client(serving(sse_bytes(events), "text/event-stream")).messages.create(
        model="claude-agent", max_tokens=64, messages=[{"role": "user", "content": "weather?"}], stream=True
    ))  # fmt: skip
    assert [e.type for e in raw] == [n for n, _ in events]
    assert [e.delta.partial_json for e in raw if e.type == "content_block_delta" and e.index == 1] == [
        '{"city": ', '"Paris"}'
    ]  # fmt: skip


def test_empty_stream_still_has_one_text_block() -> None:
    writer = AnthropicStreamWriter()
    events = writer.start("msg_x", "claude-agent", input_tokens=3)
    events += writer.feed(chunk({"role": "assistant", "content": ""}))
    events += writer.finish("stop", None)
    assert [n for n, _ in events] == [
        "message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"
    ]  # fmt: skip
    assert events[0][1]["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0}
    with sdk_client(serving(sse_bytes(events), "text/event-stream")).messages.stream(
        model="claude-agent", max_tokens=6, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", "")]
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", 0)


def test_reasoning_and_other_choices_are_not_streamed() -> None:
    writer = AnthropicStreamWriter()
    writer.start("msg_x", "m")
    other = chunk({"content": "zzz"})
    other["choices"][0]["index"] = 1
    assert writer.feed(chunk({"reasoning": "hmm", "reasoning_content": "hmm"})) == []
    assert writer.feed(other) == []
    assert writer.feed({"id": "x", "choices": [], "usage": {"completion_tokens": 1}}) == []


def test_a_resumed_tool_call_cannot_be_expressed() -> None:
    writer = AnthropicStreamWriter()
    writer.start("msg_x", "m")
    writer.feed(chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": "{"}}]}))
    writer.feed(chunk({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}}]}))
    with pytest.raises(ValueError, match="tool call 0 continued after its content block was closed"):
        writer.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}))


def test_writer_calls_out_of_order_raise() -> None:
    writer = AnthropicStreamWriter()
    with pytest.raises(RuntimeError):
        writer.feed(chunk({"content": "a"}))
    writer.start("msg_x", "m")
    with pytest.raises(RuntimeError):
        writer.start("msg_x", "m")
    writer.finish("stop", {"completion_tokens": 1})
    with pytest.raises(RuntimeError):
        writer.finish("stop", None)
