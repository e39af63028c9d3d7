"""Stream aggregation (§3.6) on the real vLLM stream and built chunks; client views (§3.7) through the OpenAI SDK."""

from __future__ import annotations

import copy
import time
from typing import Any

import openai
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.proxy.openai_shapes import (
    ClientWants,
    StreamAggregator,
    client_view_chunk,
    client_view_response,
    client_wants,
    parse_completion,
)
from openjiuwen.agent_evolving.agent_rl.gateway.proxy.sse import DONE, SSEDecoder, encode_sse
from openjiuwen.agent_evolving.agent_rl.online.capture.response import validate_response
from openjiuwen.agent_evolving.agent_rl.online.store.codec import unpack_ids, unpack_logprobs
from tests.conftest import FIXTURES, load_fixture

try:  # the official SDKs moved from httpx to httpx2; the mock transport must come from the SDK's own library
    import httpx2 as sdk_http
except ImportError:  # pragma: no cover - an SDK release still on httpx
    import httpx as sdk_http  # type: ignore[no-redef]

PRIVATE_KEYS = frozenset(
    {"prompt_token_ids", "prompt_logprobs", "prompt_text", "rl_lora", "token_ids", "routed_experts",
     "routing_metadata"}
)  # fmt: skip


def recorded_chunks(name: str = "chat_stream_response.sse") -> list[dict[str, Any]]:
    decoder = SSEDecoder(1 << 20)
    events = decoder.feed((FIXTURES / name).read_bytes()) + decoder.close()
    assert events[-1].data == DONE
    return [orjson.loads(e.data) for e in events[:-1]]


def aggregate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    aggregator = StreamAggregator()
    for chunk in chunks:
        aggregator.feed(chunk)
    return aggregator.result()


def private_keys_in(value: Any) -> set[str]:
    """Every private key anywhere in a JSON value (private fields must not hide in nested objects either)."""
    found: set[str] = set()
    if isinstance(value, dict):
        found |= PRIVATE_KEYS & value.keys()
        for v in value.values():
            found |= private_keys_in(v)
    elif isinstance(value, list):
        for v in value:
            found |= private_keys_in(v)
    return found


def delta_chunk(delta: dict[str, Any], **choice: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **choice}],
    }


# ------------------------------------------------------------------------------------------------- aggregation


def test_recorded_stream_aggregates_to_a_valid_capture_response() -> None:
    chunks = recorded_chunks()
    result = aggregate(chunks)
    assert list(result) == ["id", "object", "model", "prompt_token_ids", "choices", "usage"]
    assert result["id"] == "chatcmpl-9299d34851db2286"
    assert (result["object"], result["model"]) == ("chat.completion", "tiny")
    assert result["prompt_token_ids"] == chunks[0]["prompt_token_ids"]
    assert result["usage"] == {"prompt_tokens": 11, "total_tokens": 17, "completion_tokens": 6}
    (choice,) = result["choices"]
    assert list(choice) == ["index", "message", "finish_reason", "token_ids", "logprobs"]
    assert choice["message"] == {
        "role": "assistant",
        "content": "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]),
    }
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] == [225, 42, 67, 128, 9, 310]
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["", "H", "a", "", "'", "wor"]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == result["usage"]["completion_tokens"]

    validated = validate_response(result, policy_model="tiny")
    assert unpack_ids(validated.prompt_ids) == chunks[0]["prompt_token_ids"]
    assert unpack_ids(validated.response_ids) == choice["token_ids"]
    assert unpack_logprobs(validated.logprobs)[1] == pytest.approx(-5.583738327026367)


def test_recorded_stream_of_the_injected_request_aggregates_with_each_sampled_logprob() -> None:
    """What vLLM streams for the request the RL Service injects (`top_logprobs=0`): every token's logprob with no
    alternatives; the aggregate validates and carries one logprob per token id."""
    chunks = recorded_chunks("chat_stream_response_top0.sse")
    result = aggregate(chunks)
    (choice,) = result["choices"]
    entries = choice["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in entries)
    assert len(entries) == len(choice["token_ids"]) == result["usage"]["completion_tokens"]
    validated = validate_response(result, policy_model="tiny")
    assert unpack_ids(validated.response_ids) == choice["token_ids"]
    assert unpack_logprobs(validated.logprobs) == pytest.approx([e["logprob"] for e in entries])


def test_recorded_stream_with_the_clients_sampling_and_top_logprobs_aggregates() -> None:
    """vLLM 0.32 with `--logprobs-mode processed_logprobs` answering an injected request that carries the client's
    sampling (temperature 1.3, top_p 0.9) and `top_logprobs` 2: each entry lists the sampled token first, then the
    top alternative; the aggregate validates with the sampled tokens' logprobs."""
    chunks = recorded_chunks("chat_stream_response_sampling.sse")
    result = aggregate(chunks)
    (choice,) = result["choices"]
    entries = choice["logprobs"]["content"]
    assert len(entries) == len(choice["token_ids"]) == result["usage"]["completion_tokens"] == 6
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in entries)
    validated = validate_response(result, policy_model="tiny")
    assert unpack_logprobs(validated.logprobs) == pytest.approx([e["logprob"] for e in entries])


def test_aggregation_does_not_mutate_chunks_and_result_is_independent() -> None:
    chunks = recorded_chunks()
    before = copy.deepcopy(chunks)
    aggregator = StreamAggregator()
    for chunk in chunks:
        aggregator.feed(chunk)
    first = aggregator.result()
    first["choices"][0]["token_ids"].append(999)
    first["choices"][0]["logprobs"]["content"].clear()
    assert chunks == before
    assert aggregator.result()["choices"][0]["token_ids"] == [225, 42, 67, 128, 9, 310]


def test_tool_calls_merge_by_index_across_chunks() -> None:
    chunks = [
        delta_chunk({"role": "assistant"}),
        delta_chunk({"tool_calls": [
            {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        ]}),
        delta_chunk({"tool_calls": [{"index": 0, "id": None, "function": {"arguments": '{"city": '}}]}),
        delta_chunk({"tool_calls": [
            {"index": 0, "function": {"arguments": '"Paris"}'}},
            {"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{"}},
        ]}),
        delta_chunk({"tool_calls": [{"index": 1, "function": {"name": None, "arguments": '"tz": "CET"}'}}]}),
        delta_chunk({}, finish_reason="tool_calls"),
    ]  # fmt: skip
    message = aggregate(chunks)["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,  # no content delta ever came, as in a non-streamed tool-call answer
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
        ],
    }
    assert aggregate(chunks)["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_calls_are_ordered_by_index_not_arrival() -> None:
    chunks = [
        delta_chunk({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}}]}),
        delta_chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": "{}"}}]}),
    ]
    calls = aggregate(chunks)["choices"][0]["message"]["tool_calls"]
    assert [c["id"] for c in calls] == ["a", "b"]
    assert all(c["type"] == "function" for c in calls)


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_reasoning_is_concatenated_and_reported_as_reasoning_content(key: str) -> None:
    chunks = [
        delta_chunk({"role": "assistant", key: "Let me "}),
        delta_chunk({key: "think."}),
        delta_chunk({key: None, "content": "Hi"}),
        delta_chunk({"content": "!"}, finish_reason="stop"),
    ]
    message = aggregate(chunks)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hi!", "reasoning_content": "Let me think."}


def test_reasoning_sent_under_both_keys_is_not_doubled() -> None:
    chunks = [delta_chunk({"reasoning_content": "ab", "reasoning": "ab"}), delta_chunk({"reasoning": "c"})]
    assert aggregate(chunks)["choices"][0]["message"]["reasoning_content"] == "abc"


def test_id_and_model_are_the_last_non_empty_and_finish_reason_the_last_non_null() -> None:
    first = delta_chunk({"content": "a"}, finish_reason="length")
    second = dict(delta_chunk({"content": "b"}), id="chatcmpl-2", model="tiny:v1")
    third = dict(delta_chunk({"content": "c"}), id="", model="")
    result = aggregate([first, second, third])
    assert (result["id"], result["model"]) == ("chatcmpl-2", "tiny:v1")
    assert result["choices"][0]["finish_reason"] == "length"
    assert result["choices"][0]["message"]["content"] == "abc"


def test_usage_comes_from_the_usage_only_chunk() -> None:
    continuous = dict(delta_chunk({"content": "a"}), usage={"prompt_tokens": 1, "completion_tokens": 1})
    final = {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
    later = dict(delta_chunk({}), usage={"prompt_tokens": 1, "completion_tokens": 9})
    assert aggregate([continuous, final, later])["usage"] == final["usage"]
    # Without a usage-only chunk the last continuous usage is the best there is.
    assert aggregate([continuous])["usage"] == continuous["usage"]
    assert aggregate([delta_chunk({"content": "a"})])["usage"] is None


def test_other_choices_are_ignored() -> None:
    chunk = delta_chunk({"content": "a"}, token_ids=[1])
    chunk["choices"].append({"index": 1, "delta": {"content": "zzz"}, "token_ids": [2], "finish_reason": "stop"})
    choice = aggregate([chunk])["choices"][0]
    assert (choice["message"]["content"], choice["token_ids"], choice["finish_reason"]) == ("a", [1], None)


def test_routed_experts_are_carried() -> None:
    chunks = [
        delta_chunk({"content": "a"}, token_ids=[5], routed_experts=[[[1, 2]]]),
        delta_chunk({"content": "b"}, token_ids=[6], routed_experts=[[[3, 4]]], routing_metadata={"layers": 1}),
    ]
    choice = aggregate(chunks)["choices"][0]
    assert choice["routed_experts"] == [[[1, 2]], [[3, 4]]]
    assert choice["routing_metadata"] == {"layers": 1}
    assert chunks[0]["choices"][0]["routed_experts"] == [[[1, 2]]]  # extended a copy, not the chunk's list


def test_a_chunk_that_is_not_an_object_is_refused() -> None:
    aggregator = StreamAggregator()
    with pytest.raises(ValueError, match="JSON object"):
        aggregator.feed([])  # type: ignore[arg-type]


def test_long_streams_aggregate_in_linear_time() -> None:
    n = 50_000  # a quadratic join (str +=, list + list) of this many pieces takes many seconds
    chunks = [
        delta_chunk(
            {"content": "x", "tool_calls": [{"index": 0, "function": {"arguments": "y"}}]},
            token_ids=[i % 300],
            logprobs={"content": [{"token": "x", "logprob": -1.0}]},
        )
        for i in range(n)
    ]
    started = time.perf_counter()
    result = aggregate(chunks)
    assert time.perf_counter() - started < 3.0
    choice = result["choices"][0]
    assert len(choice["message"]["content"]) == len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == n
    assert len(choice["message"]["tool_calls"][0]["function"]["arguments"]) == n


# ------------------------------------------------------------------------------------------------ client views


def test_client_wants_reads_the_original_request() -> None:
    assert client_wants(load_fixture("chat_stream_request.json")) == ClientWants(
        logprobs=True, usage=True, stream=True, model="tiny"
    )
    assert client_wants({"model": 3, "logprobs": 1, "stream": "yes", "stream_options": {"include_usage": 1}}) == (
        ClientWants(logprobs=False, usage=False, stream=False, model=None)
    )
    assert client_wants({}) == ClientWants(False, False, False, None)


@pytest.mark.parametrize("name", ["chat_response.json", "chat_response_top0.json", "chat_lora_response.json"])
def test_client_view_of_recorded_json_hides_every_private_field(name: str) -> None:
    body = load_fixture(name)
    before = copy.deepcopy(body)
    view = client_view_response(body, wants_logprobs=False, client_model="agent-model")
    assert body == before
    assert private_keys_in(view) == set()
    assert "logprobs" not in view["choices"][0]
    assert view["model"] == "agent-model"
    assert view["usage"] == {
        k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    assert view["choices"][0]["message"] == body["choices"][0]["message"]
    assert (view["id"], view["object"], view["choices"][0]["finish_reason"]) == (
        body["id"], "chat.completion", body["choices"][0]["finish_reason"]
    )  # fmt: skip


def test_client_view_keeps_logprobs_when_asked_and_model_when_no_client_model() -> None:
    body = load_fixture("chat_response.json")
    view = client_view_response(body, wants_logprobs=True, client_model=None)
    assert view["choices"][0]["logprobs"] == body["choices"][0]["logprobs"]
    assert view["model"] == "tiny"
    assert private_keys_in(view) == set()


def test_rl_lora_field_is_dropped() -> None:
    body = dict(load_fixture("chat_lora_response.json"), rl_lora={"name": "tiny:v1"})
    assert "rl_lora" not in client_view_response(body, wants_logprobs=True, client_model=None)


@pytest.mark.parametrize("wants_logprobs", [False, True])
def test_client_view_of_recorded_chunks(wants_logprobs: bool) -> None:
    chunks = recorded_chunks()
    before = copy.deepcopy(chunks)
    with_usage = [
        client_view_chunk(c, wants_logprobs=wants_logprobs, wants_usage=True, client_model="agent-model")
        for c in chunks
    ]
    without_usage = [
        client_view_chunk(c, wants_logprobs=wants_logprobs, wants_usage=False, client_model="agent-model")
        for c in chunks
    ]
    assert chunks == before
    assert without_usage[-1] is None and None not in without_usage[:-1]
    assert with_usage[-1] == {
        "id": chunks[-1]["id"],
        "object": "chat.completion.chunk",
        "created": chunks[-1]["created"],
        "model": "agent-model",
        "choices": [],
        "usage": {"prompt_tokens": 11, "total_tokens": 17, "completion_tokens": 6},
        "system_fingerprint": "vllm-0.32.0-ba0da312",
    }
    for view in with_usage + without_usage[:-1]:
        assert view is not None
        assert private_keys_in(view) == set()
        assert view["model"] == "agent-model"
        for choice in view["choices"]:
            assert ("logprobs" in choice) is wants_logprobs
    assert with_usage[:-1] == without_usage[:-1]


def test_continuous_usage_on_ordinary_chunks_follows_include_usage() -> None:
    chunk = dict(delta_chunk({"content": "a"}), usage={"prompt_tokens": 1, "completion_tokens": 1,
                                                        "total_tokens": 2, "prompt_tokens_details": None})
    assert "usage" not in client_view_chunk(chunk, wants_logprobs=False, wants_usage=False, client_model=None)
    view = client_view_chunk(chunk, wants_logprobs=False, wants_usage=True, client_model=None)
    assert view["usage"] == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    assert view["model"] == "tiny"


# -------------------------------------------------------------------------------------- through the OpenAI SDK


def sdk_client(handler: Any) -> openai.OpenAI:
    http = sdk_http.Client(transport=sdk_http.MockTransport(handler))
    return openai.OpenAI(api_key="test", base_url="http://gateway.test/v1", http_client=http, max_retries=0)


def test_openai_sdk_parses_the_json_view_without_private_attributes() -> None:
    body = load_fixture("chat_response.json")

    def handler(request: Any) -> Any:
        view = client_view_response(body, wants_logprobs=False, client_model="agent-model")
        return sdk_http.Response(200, content=orjson.dumps(view), headers={"content-type": "application/json"})

    completion = sdk_client(handler).chat.completions.create(
        model="agent-model", messages=[{"role": "user", "content": "hello"}]
    )
    assert completion.model == "agent-model"
    assert completion.choices[0].message.content == body["choices"][0]["message"]["content"]
    assert completion.choices[0].logprobs is None
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    for model in (completion, completion.choices[0], completion.usage):
        assert PRIVATE_KEYS.isdisjoint(model.model_extra or {})
    assert private_keys_in(completion.to_dict()) == set()


@pytest.mark.parametrize("include_usage", [False, True])
def test_openai_sdk_parses_the_stream_view_without_private_attributes(include_usage: bool) -> None:
    chunks = recorded_chunks()

    def handler(request: Any) -> Any:
        wants = client_wants(orjson.loads(request.content))
        body = b"".join(
            encode_sse(orjson.dumps(view))
            for c in chunks
            if (view := client_view_chunk(c, wants_logprobs=wants.logprobs, wants_usage=wants.usage,
                                          client_model=wants.model)) is not None
        ) + encode_sse(DONE)  # fmt: skip
        return sdk_http.Response(200, content=body, headers={"content-type": "text/event-stream"})

    stream = sdk_client(handler).chat.completions.create(
        model="agent-model",
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True} if include_usage else openai.omit,
    )
    received = list(stream)
    assert len(received) == (8 if include_usage else 7)
    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    assert text == aggregate(chunks)["choices"][0]["message"]["content"]
    tokens = [t.token for c in received if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == ["", "H", "a", "", "'", "wor"]
    if include_usage:
        assert received[-1].choices == [] and received[-1].usage.completion_tokens == 6
    else:
        assert all(c.choices and c.usage is None for c in received)
    for chunk in received:
        assert chunk.model == "agent-model"
        assert PRIVATE_KEYS.isdisjoint(chunk.model_extra or {})
        assert all(PRIVATE_KEYS.isdisjoint(choice.model_extra or {}) for choice in chunk.choices)
        assert private_keys_in(chunk.to_dict()) == set()


# ------------------------------------------------------------------------------------------- parsing an answer


def _without_token_bytes(body: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    for choice in out["choices"]:
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            entry.pop("bytes")
            for alt in entry.get("top_logprobs") or []:
                alt.pop("bytes")
    return out


@pytest.mark.parametrize("name", ["chat_response.json", "chat_response_top0.json", "chat_lora_response.json"])
def test_an_answer_is_parsed_without_token_bytes_unless_the_client_asked_for_logprobs(name: str) -> None:
    raw = (FIXTURES / name).read_bytes()
    full = orjson.loads(raw)
    assert parse_completion(raw, keep_token_bytes=True) == full
    assert parse_completion(raw, keep_token_bytes=False) == _without_token_bytes(full)


def test_token_bytes_inside_a_string_are_text_and_stay() -> None:
    content = 'a key in prose: ,"bytes":[1,2] and {"bytes":[3]}'
    body = {"choices": [{"message": {"content": content},
                         "logprobs": {"content": [{"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}]}}]}
    parsed = parse_completion(orjson.dumps(body), keep_token_bytes=False)
    assert parsed["choices"][0]["message"]["content"] == content
    assert parsed["choices"][0]["logprobs"]["content"] == [{"token": "a", "logprob": -1.0, "top_logprobs": []}]
    with pytest.raises(ValueError):
        parse_completion(b'{"choices": [', keep_token_bytes=False)


def test_several_choices_interleaved_as_vllm_streams_them_aggregate_per_choice() -> None:
    """Issue 35: a stream of `n` = 2 choices in vLLM 0.32's layout (a role chunk per choice, then each step's chunks
    one choice each, naming its index, then one usage chunk for all) aggregates into both choices, each exactly what
    its own stream alone aggregates to, and the RL Service's `:after` accepts it as two samples."""
    recorded = recorded_chunks("chat_stream_response_top0.sse")
    *tokens, usage_chunk = recorded[1:]
    assert usage_chunk["choices"] == [] and all(c["choices"] for c in tokens)

    def renumbered(chunk: dict[str, Any], variant: int, index: int | None = None) -> dict[str, Any]:
        out = copy.deepcopy(chunk)
        for choice in out["choices"]:
            choice["index"] = variant if index is None else index
            if variant and isinstance(choice.get("token_ids"), list):  # the second choice drew other tokens
                choice["token_ids"] = [t + 1 for t in choice["token_ids"]]
                if choice["delta"].get("content"):
                    choice["delta"]["content"] = choice["delta"]["content"].upper()
        return out

    streams = [[renumbered(c, i) for c in [recorded[0], *tokens]] for i in range(2)]
    interleaved = [streams[0][0], streams[1][0]]
    for step in range(1, len(streams[0])):
        interleaved += [streams[0][step], streams[1][step]]
    usage = dict(usage_chunk["usage"])
    usage["completion_tokens"] *= 2
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    interleaved.append(dict(usage_chunk, usage=usage))
    interleaved.append(renumbered(tokens[0], 7))  # an index past `n` (a malformed upstream): left out

    aggregator = StreamAggregator(2)
    for chunk in interleaved:
        aggregator.feed(chunk)
    result = aggregator.result()
    assert [c["index"] for c in result["choices"]] == [0, 1]
    for i in range(2):
        alone = aggregate([renumbered(c, i, index=0) for c in [recorded[0], *tokens]] + [usage_chunk])["choices"][0]
        assert {k: v for k, v in result["choices"][i].items() if k != "index"} == {
            k: v for k, v in alone.items() if k != "index"}
    assert result["choices"][1]["message"]["content"] == result["choices"][0]["message"]["content"].upper()
    validated = validate_response(result, policy_model=result["model"], n=2)
    assert unpack_ids(validated.others[0].response_ids) == [t + 1 for t in unpack_ids(validated.response_ids)]
    assert StreamAggregator().result()["choices"][0]["index"] == 0  # one choice by default, as before
