"""OpenAI chat shapes: stream aggregation (CONTRACT §3.6) and the client-facing views without private fields (§3.7)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

# Private fields: asked for by the gateway/RL injection (token ids, logprobs, routing) or vLLM internals. They feed
# the capture hooks only; no client ever sees them, captured or not.
PRIVATE_TOP_LEVEL = frozenset(
    {"prompt_token_ids", "prompt_logprobs", "prompt_text", "rl_lora", "routed_experts", "routing_metadata"}
)
PRIVATE_CHOICE = frozenset({"token_ids", "routed_experts", "routing_metadata"})
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")
# A logprob entry's `"bytes":[…]`, the token's UTF-8 bytes as a list of small integers: most of the objects a parse of
# a captured answer creates. Only inside JSON text as a key: a `"` within a JSON string is always escaped (`\"`).
_TOKEN_BYTES = re.compile(rb',"bytes":\[[0-9,]*\]')


@dataclass(frozen=True, slots=True)
class ClientWants:
    """What the client's own request asked for (before any injection)."""

    logprobs: bool  # `logprobs: true`
    usage: bool  # `stream_options.include_usage: true`
    stream: bool  # `stream: true`
    model: str | None  # the client's `model`, echoed back instead of the pinned policy model


def stream_fields_refused(request: dict[str, Any]) -> str | None:
    """Why `stream` / `stream_options` cannot be served, or None. vLLM coerces `"stream": 1` to a stream while the
    gateway reads only JSON `true` as one: left through, such a request would be relayed as JSON and fail as a 502."""
    stream = request.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return "stream must be a boolean"
    options = request.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return "stream_options must be an object"
    return None


def client_wants(request: dict[str, Any]) -> ClientWants:
    """Read from the ORIGINAL client request: the injected one always asks for logprobs and usage."""
    options = request.get("stream_options")
    model = request.get("model")
    return ClientWants(
        logprobs=request.get("logprobs") is True,
        usage=isinstance(options, dict) and options.get("include_usage") is True,
        stream=request.get("stream") is True,
        model=model if isinstance(model, str) else None,
    )


def _view_choice(choice: Any, wants_logprobs: bool) -> Any:
    if not isinstance(choice, dict):
        return choice
    view = {k: v for k, v in choice.items() if k not in PRIVATE_CHOICE}
    if not wants_logprobs:
        view.pop("logprobs", None)
    return view


def _view_usage(usage: Any) -> Any:
    if not isinstance(usage, dict):
        return usage  # null stays null
    return {k: usage[k] for k in USAGE_KEYS if k in usage}


def parse_completion(content: bytes, *, keep_token_bytes: bool) -> Any:
    """A JSON answer parsed; without `keep_token_bytes` the logprob entries come without their `bytes`. Nothing but a
    client that asked for logprobs reads them (the capture keeps token ids and logprobs, and the RL Service's JSON
    `:after` gets the upstream's own bytes), and cutting them from the text first makes a large captured answer's
    parse and release a third cheaper. Raises ValueError for invalid JSON."""
    if not keep_token_bytes and b'"bytes":[' in content:
        content = _TOKEN_BYTES.sub(b"", content)
    return orjson.loads(content)


def client_view_response(body: dict[str, Any], *, wants_logprobs: bool, client_model: str | None) -> dict[str, Any]:
    """A non-streamed completion as the client may see it. `body` is not mutated (the capture hook gets it whole)."""
    view = {k: v for k, v in body.items() if k not in PRIVATE_TOP_LEVEL}
    choices = body.get("choices")
    if isinstance(choices, list):
        view["choices"] = [_view_choice(c, wants_logprobs) for c in choices]
    if "usage" in view:
        view["usage"] = _view_usage(view["usage"])
    if client_model is not None:
        view["model"] = client_model
    return view


def client_view_chunk(
    chunk: dict[str, Any], *, wants_logprobs: bool, wants_usage: bool, client_model: str | None
) -> dict[str, Any] | None:
    """One SSE chunk as the client may see it, or None when it must not be forwarded at all (the usage-only chunk
    the client did not ask for). `usage` on other chunks (vLLM continuous usage) follows the same choice."""
    choices = chunk.get("choices")
    if choices == [] and chunk.get("usage") is not None and not wants_usage:
        return None
    view = {k: v for k, v in chunk.items() if k not in PRIVATE_TOP_LEVEL}
    if isinstance(choices, list):
        view["choices"] = [_view_choice(c, wants_logprobs) for c in choices]
    if "usage" in view:
        if wants_usage:
            view["usage"] = _view_usage(view["usage"])
        else:
            del view["usage"]
    if client_model is not None and "model" in view:
        view["model"] = client_model
    return view


class _ToolCallParts:
    __slots__ = ("id", "type", "name", "arguments")

    def __init__(self) -> None:
        self.id: str | None = None
        self.type: str | None = None
        self.name: str | None = None
        self.arguments: list[str] = []

    def result(self) -> dict[str, Any]:
        return {
            "id": self.id or "",
            "type": self.type or "function",
            "function": {"name": self.name or "", "arguments": "".join(self.arguments)},
        }


class _ChoiceParts:
    """The pieces of one choice of a stream, joined once in `result()`."""

    __slots__ = ("content", "content_seen", "reasoning", "reasoning_seen", "token_ids", "logprobs", "tool_calls",
                 "finish_reason", "routed_experts", "routing_metadata")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.content_seen = False
        self.reasoning: list[str] = []
        self.reasoning_seen = False
        self.token_ids: list[Any] = []
        self.logprobs: list[Any] = []
        self.tool_calls: dict[Any, _ToolCallParts] = {}
        self.finish_reason: Any = None
        self.routed_experts: Any = None
        self.routing_metadata: Any = None

    def feed(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            content = delta.get("content")
            if isinstance(content, str):
                self.content_seen = True
                self.content.append(content)
            # vLLM renamed `reasoning_content` to `reasoning`; some versions send both with the same text.
            reasoning = delta.get("reasoning_content")
            if not isinstance(reasoning, str):
                reasoning = delta.get("reasoning")
            if isinstance(reasoning, str):
                self.reasoning_seen = True
                self.reasoning.append(reasoning)
            tool_calls = delta.get("tool_calls")
            if isinstance(tool_calls, list):
                for call in tool_calls:
                    if isinstance(call, dict):
                        self._merge_tool_call(call)
        token_ids = choice.get("token_ids")
        if isinstance(token_ids, list):
            self.token_ids.extend(token_ids)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            self.logprobs.extend(logprobs["content"])
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        self.routing(choice)

    def _merge_tool_call(self, call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        parts = self.tool_calls.get(index)
        if parts is None:
            parts = self.tool_calls[index] = _ToolCallParts()
        # Overwrite only with a value: later deltas of a call usually repeat `id`/`name` as null or leave them out.
        if call.get("id"):
            parts.id = call["id"]
        if call.get("type"):
            parts.type = call["type"]
        function = call.get("function")
        if isinstance(function, dict):
            if function.get("name"):
                parts.name = function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                parts.arguments.append(arguments)

    def routing(self, holder: dict[str, Any]) -> None:
        # MoE routing travels per chunk (per-token lists, concatenated) or once (any other value, last one wins).
        routed = holder.get("routed_experts")
        if routed is not None:
            if isinstance(routed, list) and isinstance(self.routed_experts, list):
                self.routed_experts.extend(routed)
            else:
                self.routed_experts = list(routed) if isinstance(routed, list) else routed
        if holder.get("routing_metadata") is not None:
            self.routing_metadata = holder["routing_metadata"]

    def result(self, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) if self.content_seen else None,
        }
        if self.reasoning_seen:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i].result() for i in sorted(self.tool_calls, key=_index_key)]
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": self.finish_reason,
            "token_ids": list(self.token_ids),
            "logprobs": {"content": list(self.logprobs)},
        }
        if self.routed_experts is not None:
            choice["routed_experts"] = (
                list(self.routed_experts) if isinstance(self.routed_experts, list) else self.routed_experts
            )
        if self.routing_metadata is not None:
            choice["routing_metadata"] = self.routing_metadata
        return choice


class StreamAggregator:
    """Builds the one `chat.completion` that `:after` receives from the OpenAI chunks of a stream (§3.6).

    Linear in the stream: pieces go to lists and are joined once in `result()`. The chunks of the `n` choices of a
    request (vLLM interleaves them, each chunk naming its choice's `index`) are aggregated per choice; a chunk naming
    any other index is left out. Chunks are read, never mutated.
    """

    __slots__ = ("_id", "_model", "_prompt_token_ids", "_final_usage", "_last_usage", "_choices")

    def __init__(self, n: int = 1) -> None:
        self._id = ""
        self._model = ""
        self._prompt_token_ids: Any = None
        self._final_usage: dict[str, Any] | None = None  # from the usage-only chunk (`choices: []`)
        self._last_usage: dict[str, Any] | None = None  # continuous usage on ordinary chunks, a fallback
        self._choices = [_ChoiceParts() for _ in range(max(1, n))]

    def feed(self, chunk: dict[str, Any]) -> None:
        if not isinstance(chunk, dict):
            raise ValueError("a stream chunk must be a JSON object")
        value = chunk.get("id")
        if isinstance(value, str) and value:
            self._id = value
        value = chunk.get("model")
        if isinstance(value, str) and value:
            self._model = value
        if chunk.get("prompt_token_ids") is not None:
            self._prompt_token_ids = chunk["prompt_token_ids"]
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if choices == []:
                self._final_usage = usage
            else:
                self._last_usage = usage
        first = self._choices[0]
        first.routing(chunk)  # routing on the chunk itself belongs to the first choice, as with one
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    index = choice.get("index", 0)
                    if index == 0:
                        first.feed(choice)
                    elif type(index) is int and 0 < index < len(self._choices):
                        self._choices[index].feed(choice)

    def result(self) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion",
            "model": self._model,
            "prompt_token_ids": self._prompt_token_ids,
            "choices": [parts.result(index) for index, parts in enumerate(self._choices)],
            "usage": self._final_usage if self._final_usage is not None else self._last_usage,
        }


def _index_key(index: Any) -> tuple[int, Any]:
    # Integer indexes in order; anything odd (a malformed upstream) after them, without a TypeError on comparison.
    return (0, index) if type(index) is int else (1, repr(index))
