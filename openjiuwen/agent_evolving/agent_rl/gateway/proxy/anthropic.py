"""Anthropic Messages ⇄ OpenAI chat: the request, the response and the SSE event sequence (CONTRACT §3.7).

Requests are converted strictly: anything this module cannot express in OpenAI chat (an unknown content block, a
server tool, a document) raises `ValueError` with the path of the offending item, so the gateway answers 400 rather
than silently dropping content the model should have seen. What shapes generation is carried over as vLLM's own
Anthropic endpoint does (issue 35): a tool's `strict`, `output_config.format` (structured output, as
`response_format` `json_schema`), `output_config.effort` (`reasoning_effort`) and `thinking.budget_tokens` of enabled
thinking (`thinking_token_budget`). Two deliberate exceptions: `thinking` and `redacted_thinking` blocks in assistant
history are dropped (earlier reasoning is not replayed to the model, as chat templates do), and top-level keys with no
OpenAI counterpart (`metadata`, `service_tier`, `thinking` other than enabled, …) are ignored.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import orjson

from ...common import json_nesting

AnthropicEvent = tuple[str, dict[str, Any]]  # (SSE event name, its JSON payload)

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}
_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k")
_SKIPPED_ASSISTANT_BLOCKS = frozenset({"thinking", "redacted_thinking"})


def stop_reason(finish_reason: str | None) -> str:
    """OpenAI `finish_reason` → Anthropic `stop_reason`: stop → end_turn, length → max_tokens, tool_calls →
    tool_use, anything else → end_turn."""
    return _STOP_REASONS.get(finish_reason or "", "end_turn")


def anthropic_message_id(completion_id: str | None) -> str:
    """`msg_` + the upstream completion id, so logs of both sides can be matched; a fresh id when there is none."""
    return "msg_" + (completion_id or uuid.uuid4().hex)


# ------------------------------------------------------------------------------------------------------- request


def anthropic_to_openai_request(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic `/v1/messages` body as an OpenAI chat request. `stream: true` also asks for the usage chunk,
    which the Anthropic `message_delta` needs. Raises `ValueError` for input that cannot be converted."""
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise ValueError("model must be a string")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    out_messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:  # an empty system prompt means none (a system message would change the chat template's rendering)
        out_messages.append({"role": "system", "content": system})
    for i, message in enumerate(messages):
        out_messages.extend(_convert_message(message, f"messages[{i}]"))
    request: dict[str, Any] = {"model": model, "messages": out_messages}
    for key in _SAMPLING_KEYS:
        if body.get(key) is not None:
            request[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop_sequences must be a list of strings")
        request["stop"] = list(stops)
    if body.get("stream") is not None:
        if not isinstance(body["stream"], bool):
            raise ValueError("stream must be a boolean")
        request["stream"] = body["stream"]
        if body["stream"]:
            request["stream_options"] = {"include_usage": True}
    if body.get("tools") is not None:
        request["tools"] = _convert_tools(body["tools"])
    if body.get("tool_choice") is not None:
        choice, parallel = _convert_tool_choice(body["tool_choice"])
        request["tool_choice"] = choice
        if parallel is not None:
            request["parallel_tool_calls"] = parallel
    request.update(_output_config(body.get("output_config")))
    budget = _thinking_budget(body.get("thinking"))
    if budget is not None:
        request["thinking_token_budget"] = budget
    return request


def _output_config(config: Any) -> dict[str, Any]:
    """`output_config`: its JSON schema `format` as `response_format` (named as vLLM names it), its `effort` as
    `reasoning_effort`."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError("output_config must be an object")
    out: dict[str, Any] = {}
    form = config.get("format")
    if form is not None:
        if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
            raise ValueError("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "json_schema", "schema": form["schema"]}}
    effort = config.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise ValueError("output_config.effort must be a string")
        out["reasoning_effort"] = effort
    return out


def _thinking_budget(thinking: Any) -> int | None:
    """The `budget_tokens` of `thinking: {type: enabled}`; other thinking settings pin nothing."""
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        raise ValueError("thinking must be an object")
    if thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        raise ValueError("thinking.budget_tokens must be a positive integer")
    return budget


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise ValueError("system must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(system):
        if _block_type(block, f"system[{j}]") != "text":
            raise ValueError(f"system[{j}]: only text blocks are allowed in system")
        texts.append(_text(block, f"system[{j}]"))
    return "\n".join(texts)


def _convert_message(message: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object")
    role = message.get("role")
    content = message.get("content")
    if not isinstance(content, (str, list)):
        raise ValueError(f"{where}.content must be a string or a list of content blocks")
    if role == "user":
        return _user_messages(content, where)
    if role == "assistant":
        return [_assistant_message(content, where)]
    raise ValueError(f"{where}.role must be 'user' or 'assistant'")


def _user_messages(content: str | list[Any], where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    # OpenAI wants tool results right after the assistant message that called the tools, so the results of a user
    # turn come first and its other content follows as one user message.
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for at, kind, block in _content_blocks(content, where):
        if kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
        elif kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise ValueError(f"{at}.tool_use_id must be a non-empty string")
            tool_messages.append(
                {"role": "tool", "tool_call_id": tool_use_id, "content": _tool_result_text(block.get("content"), at)}
            )
        else:
            raise ValueError(f"{at}: content block type {kind!r} is not supported in a user message")
    if parts or not tool_messages:
        tool_messages.append({"role": "user", "content": _parts_content(parts)})
    return tool_messages


def _assistant_message(content: str | list[Any], where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    for at, kind, block in _content_blocks(content, where):
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "tool_use":
            tool_calls.append(_tool_call(block, at))
        elif kind in _SKIPPED_ASSISTANT_BLOCKS:
            continue
        else:
            raise ValueError(f"{at}: content block type {kind!r} is not supported in an assistant message")
    text = _parts_content(parts) if parts or not tool_calls else None  # OpenAI: null content beside tool calls
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _content_blocks(content: list[Any], where: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(where in the request, block type, block) of each content block of a message, its type checked."""
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        yield at, _block_type(block, at), block


def _parts_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A lone text part as a plain string (what most chat templates expect); otherwise the list of parts."""
    if not parts:
        return ""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise ValueError(f"{where} must be an object")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise ValueError(f"{where}.type must be a string")
    return kind


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}.text must be a string")
    return text


def _image_url(block: dict[str, Any], where: str) -> str:
    source = block.get("source")
    if not isinstance(source, dict):
        raise ValueError(f"{where}.source must be an object")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise ValueError(f"{where}.source needs string media_type and data")
        return f"data:{media_type};base64,{data}"
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise ValueError(f"{where}.source.url must be a string")
        return url
    raise ValueError(f"{where}.source.type {kind!r} is not supported (base64 or url)")


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text blocks")
    texts = []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        if _block_type(block, at) != "text":
            raise ValueError(f"{at}: only text blocks are supported in a tool_result")
        texts.append(_text(block, at))
    return "\n".join(texts)


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise ValueError(f"{where}.id must be a non-empty string")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name must be a non-empty string")
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.input must be an object")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
    }


def _convert_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object")
        if tool.get("type") not in (None, "custom"):
            raise ValueError(f"{where}: tool type {tool.get('type')!r} is not supported (custom tools only)")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a non-empty string")
        if not isinstance(schema, dict):
            raise ValueError(f"{where}.input_schema must be an object")
        function: dict[str, Any] = {"name": name}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = schema
        strict = tool.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise ValueError(f"{where}.strict must be a boolean")
            function["strict"] = strict  # kept: vLLM enforces a strict tool's arguments (a recorded constraint)
        out.append({"type": "function", "function": function})
    return out


def _convert_tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """(OpenAI `tool_choice`, `parallel_tool_calls` or None when the client did not restrict it)."""
    if not isinstance(choice, dict):
        raise ValueError("tool_choice must be an object")
    kind = choice.get("type")
    if kind == "auto":
        converted: Any = "auto"
    elif kind == "any":
        converted = "required"
    elif kind == "none":
        converted = "none"
    elif kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("tool_choice.name must be a non-empty string")
        converted = {"type": "function", "function": {"name": name}}
    else:
        raise ValueError(f"tool_choice.type {kind!r} is not supported (auto, any, tool, none)")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    return converted, parallel


# ------------------------------------------------------------------------------------------------------ response


def openai_to_anthropic_response(completion: dict[str, Any], *, client_model: str | None) -> dict[str, Any]:
    """A (vLLM) `chat.completion` as an Anthropic `message`. Nothing private survives: the output is built from
    scratch, never copied. Raises `ValueError` when the completion has no usable first choice."""
    choices = completion.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("completion has no choices")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ValueError("completion choices[0].message must be an object")
    message_id = anthropic_message_id(completion.get("id"))
    tool_calls = message.get("tool_calls")
    tool_calls = tool_calls if isinstance(tool_calls, list) else []
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and (text or not tool_calls):
        content.append({"type": "text", "text": text})
    elif not tool_calls:
        content.append({"type": "text", "text": ""})  # every answer has at least one block, like a streamed one
    for i, call in enumerate(tool_calls):
        call = call if isinstance(call, dict) else {}
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        content.append({
            "type": "tool_use",
            "id": call.get("id") or f"toolu_{message_id}_{i}",
            "name": function.get("name") or "",
            "input": _tool_input(function.get("arguments")),
        })
    usage = completion.get("usage") if isinstance(completion.get("usage"), dict) else {}
    model = client_model if client_model is not None else completion.get("model")
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model if isinstance(model, str) else "",
        "content": content,
        "stop_reason": stop_reason(choice.get("finish_reason")),
        "stop_sequence": None,
        "usage": {
            "input_tokens": _count(usage.get("prompt_tokens")),
            "output_tokens": _count(usage.get("completion_tokens")),
        },
    }


def _tool_input(arguments: Any) -> dict[str, Any]:
    """Tool arguments as the `input` object; a model that wrote invalid JSON (or not an object) gives `{}`."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str) or not arguments:
        return {}
    try:
        parsed = json_nesting.loads(arguments)  # bounded: the result is written again in the answer
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _count(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


# -------------------------------------------------------------------------------------------------------- stream


class AnthropicStreamWriter:
    """Turns OpenAI chunks into the Anthropic event sequence: `message_start`, per block `content_block_start` /
    `content_block_delta` (`text_delta`, `input_json_delta`) / `content_block_stop`, `message_delta`,
    `message_stop`.

    One block is open at a time, numbered 0, 1, … in order: text continues the open text block; a tool call opens
    one block per OpenAI tool-call index, closing whatever was open. Reasoning deltas are not forwarded. A delta for
    a tool call whose block was already closed cannot be expressed and raises `ValueError` (OpenAI-compatible
    servers stream calls one after another). Calls out of order (`feed` before `start`, anything after
    `finish`) raise `RuntimeError`.
    """

    __slots__ = ("_message_id", "_state", "_index", "_open", "_closed_tools")

    def __init__(self) -> None:
        self._message_id = ""
        self._state = "new"  # new → started → finished
        self._index = -1  # index of the newest block
        self._open: tuple[str, Any] | None = None  # ("text", None) or ("tool", OpenAI tool-call index)
        self._closed_tools: set[Any] = set()

    def start(self, message_id: str, model: str, *, input_tokens: int = 0) -> list[AnthropicEvent]:
        if self._state != "new":
            raise RuntimeError("start() was already called")
        self._state = "started"
        self._message_id = message_id
        message = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def feed(self, chunk: dict[str, Any]) -> list[AnthropicEvent]:
        self._require_started()
        events: list[AnthropicEvent] = []
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return events
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            text = delta.get("content")
            if isinstance(text, str) and text:  # vLLM opens with an empty delta; no block for it
                if self._open != ("text", None):
                    self._switch(("text", None), {"type": "text", "text": ""}, events)
                events.append(self._delta({"type": "text_delta", "text": text}))
            tool_calls = delta.get("tool_calls")
            if isinstance(tool_calls, list):
                for call in tool_calls:
                    if isinstance(call, dict):
                        self._tool_delta(call, events)
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, Any] | None) -> list[AnthropicEvent]:
        """Close the open block (or emit one empty text block if nothing was streamed), then `message_delta` with
        the stop reason and usage (`completion_tokens` → `output_tokens`), then `message_stop`."""
        self._require_started()
        self._state = "finished"
        events = self._close()
        if self._index < 0:
            self._switch(("text", None), {"type": "text", "text": ""}, events)
            events.extend(self._close())
        usage = usage if isinstance(usage, dict) else {}
        delta_usage: dict[str, Any] = {"output_tokens": _count(usage.get("completion_tokens"))}
        if type(usage.get("prompt_tokens")) is int:
            delta_usage["input_tokens"] = usage["prompt_tokens"]
        events.append((
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(finish_reason), "stop_sequence": None},
                "usage": delta_usage,
            },
        ))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _tool_delta(self, call: dict[str, Any], events: list[AnthropicEvent]) -> None:
        index = call.get("index", 0)
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        key = ("tool", index)
        if self._open != key:
            if index in self._closed_tools:
                raise ValueError(f"tool call {index!r} continued after its content block was closed")
            block = {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{self._message_id}_{index}",
                "name": function.get("name") or "",
                "input": {},
            }
            self._switch(key, block, events)
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))

    def _switch(self, key: tuple[str, Any], block: dict[str, Any], events: list[AnthropicEvent]) -> None:
        events.extend(self._close())
        self._index += 1
        self._open = key
        events.append(
            ("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})
        )

    def _delta(self, delta: dict[str, Any]) -> AnthropicEvent:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> list[AnthropicEvent]:
        if self._open is None:
            return []
        kind, index = self._open
        if kind == "tool":
            self._closed_tools.add(index)
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _require_started(self) -> None:
        if self._state != "started":
            raise RuntimeError(f"the writer is {self._state}; start() must come first and finish() last")
