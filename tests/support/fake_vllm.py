"""A fake vLLM 0.32 on a real loopback socket, answering in the recorded shapes (tests/fixtures/vllm-0.32-cpu).

    from tests.support.fake_vllm import FakeVLLM, Reply, ToolCall

    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm:     # or `async with`, or start()/stop()
        vllm.url, vllm.host, vllm.port, vllm.name
        vllm.reply = Reply(content="Hi there", reasoning="let me think",
                           tool_calls=[ToolCall("get_weather", {"city": "Paris"})])   # the default reply
        vllm.enqueue(Reply(content="only for the next chat request"))
        vllm.responder = lambda body: Reply(...)                     # answer each request by its body (a "model")
        vllm.fail_next("/v1/load_lora_adapter", 500)                 # vLLM-style error envelope
        vllm.fail_next("/v1/chat/completions", 429, body={"error": {...}}, times=2)
        vllm.fail_next("/v1/chat/completions", 418, body="<script>…</script>", content_type="text/html")
        vllm.delay_next("/v1/load_lora_adapter", 2.0)                # answers (and takes effect) 2 s late
        vllm.break_stream_after(3)                                   # next SSE drops the connection after 3 chunks
        vllm.bloat_next(300 << 20)                                   # next chat answer ~300 MB, written as generated
        vllm.bloat_sent                                              # bytes each bloated answer got out
        vllm.fail_loads = True                                       # every load → 500
        FakeVLLM(max_loras=2); vllm.peak_loaded                      # refuse a 3rd adapter (400); most held at once
        vllm.preload("tiny:v1", "/abs/dir"); vllm.drop_loras()       # as if loaded earlier / as if vLLM restarted
        vllm.requests, vllm.loaded, vllm.loaded_paths, vllm.chat_models, vllm.count("/v1/load_lora_adapter")
        vllm.wait_until(lambda v: "tiny:v1" in v.loaded, timeout_s=5)   # or `await vllm.wait_until_async(...)`

Routes (exactly as vLLM answers them): `POST /v1/chat/completions` (JSON or SSE; `model` must be the served model
or a loaded adapter, else 404 like error_unknown_model.txt; `max_tokens` > 1024 → 400 like error_too_long.txt),
`POST /v1/load_lora_adapter` (200 plain text; same name again → 400; path not a directory → 404),
`POST /v1/unload_lora_adapter` (200; unknown → 404), `GET /v1/models`, `GET /health` (200, empty body).

Completions are deterministic: the reply text (reasoning, then content, then each tool call's JSON arguments) is cut
into pieces of up to four characters (leading whitespace included), one token per piece, ids and logprobs derived from
a CRC of the piece; at most `max_tokens` (or `max_completion_tokens`) tokens are produced, then `finish_reason` is
"length". The injected flags are honoured like vLLM: without `return_token_ids` the fields `prompt_token_ids` and
`choices[].token_ids` are null, without `logprobs: true` `choices[].logprobs` is null (vLLM serializes these unset
optional fields as null, it does not drop the keys); the usage chunk is sent only with `stream_options.include_usage`.
`n` > 1 answers `n` choices, each drawing the next reply (queued ones first), in vLLM's layout (`_Choices`): every
choice in the JSON, interleaved choice chunks in SSE; `n` > 1 with temperature 0, and `top_logprobs` without
`logprobs: true`, are refused as vLLM refuses them.
A forced tool call (`tool_choice` "required" or a named function; chat_tool_required_*, chat_tool_named_*) answers
`content: ""` beside the calls, and a named one finishes with "stop" (vLLM's "tool_calls" is for auto and required).

Every request is recorded (also failed ones). Thread-safe: one lock guards the records, the scripted controls and the
adapters; `stop()` ends every pending delay at once.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import hashlib
import json
import os
import re
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tests.support.asgi_server import ThreadedServer
from tests.support.fake_judge import Gate

CHAT_PATH = "/v1/chat/completions"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"

MAX_MODEL_LEN = 1024
VOCAB_SIZE = 331  # the recorded tiny model's vocabulary
_FIRST_ORDINARY_ID = 3  # 0..2 are special in the recordings (1 = <|im_start|>, 2 = <|im_end|>)
_NEWLINE_ID = 201
_PIECE_RE = re.compile(r"\s*\S{1,4}|\s+$")

_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-cpu"


@functools.lru_cache(maxsize=None)
def _fixture_text(name: str) -> str:
    return (_FIXTURES / name).read_text(encoding="utf-8")


def _fixture_json(name: str) -> Any:
    return copy.deepcopy(_fixture_json_cached(name))


@functools.lru_cache(maxsize=None)
def _fixture_json_cached(name: str) -> Any:
    return json.loads(_fixture_text(name))


def _recorded_error(name: str) -> tuple[dict[str, Any], int]:
    """(error body, status) of a recording whose last line is the HTTP status."""
    lines = _fixture_text(name).strip().splitlines()
    return json.loads(lines[0]), int(lines[-1])


# ---------------------------------------------------------------------------------------------------- replies


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any] | str = field(default_factory=dict)

    def arguments_json(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(dict(self.arguments), ensure_ascii=False)


@dataclass(frozen=True)
class Reply:
    """What the model "generates": reasoning, then content, then tool calls. `finish_reason` overrides the natural
    one ("tool_calls" with tool calls, else "stop") unless the reply is cut by `max_tokens` ("length")."""

    content: str = "Hello from the fake vLLM."
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        calls = tuple(c if isinstance(c, ToolCall) else ToolCall(c["name"], c.get("arguments", {}))
                      for c in self.tool_calls)
        object.__setattr__(self, "tool_calls", calls)


@dataclass(frozen=True)
class FakeRequest:
    """One request as received. `headers` keys are lower-case; `body` is the decoded JSON or None."""

    method: str
    path: str
    body: Any
    headers: dict[str, str]


@dataclass(frozen=True)
class _Token:
    kind: str  # "reasoning" | "content" | "tool"
    text: str
    call: int = -1  # tool call index for kind "tool"
    first_of_call: bool = False

    @property
    def id(self) -> int:
        return _FIRST_ORDINARY_ID + zlib.crc32(self.text.encode()) % (VOCAB_SIZE - _FIRST_ORDINARY_ID)

    @property
    def logprob(self) -> float:
        return -round(0.25 + (zlib.crc32(b"lp" + self.text.encode()) % 1000) / 200, 6)


def _pieces(text: str) -> list[str]:
    return _PIECE_RE.findall(text)


def _ids(text: str) -> list[int]:
    return [_Token("content", p).id for p in _pieces(text)]


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    else:
        text = content if isinstance(content, str) else ""
    if message.get("tool_calls"):
        text += json.dumps(message["tool_calls"], ensure_ascii=False, sort_keys=True)
    return text


def prompt_token_ids(messages: Any) -> list[int]:
    """The fake's deterministic chat template: <s> role \\n text </s> \\n per message, then the assistant turn."""
    ids: list[int] = []
    for message in messages if isinstance(messages, list) else []:
        role = message.get("role", "") if isinstance(message, dict) else ""
        ids += [1, *_ids(str(role)), _NEWLINE_ID, *_ids(_message_text(message)), 2, _NEWLINE_ID]
    return [*ids, 1, *_ids("assistant"), _NEWLINE_ID]


def _tokens(reply: Reply) -> list[_Token]:
    tokens = [_Token("reasoning", p) for p in _pieces(reply.reasoning or "")]
    tokens += [_Token("content", p) for p in _pieces(reply.content or "")]
    for index, call in enumerate(reply.tool_calls):
        pieces = _pieces(call.arguments_json()) or [""]
        tokens += [_Token("tool", p, index, first_of_call=(n == 0)) for n, p in enumerate(pieces)]
    return tokens or [_Token("content", "")]


def completion_tokens(reply: Reply) -> list[_Token]:
    """The tokens (`.id`, `.logprob`) the fake answers `reply` with, for tests that check what was captured."""
    return _tokens(reply)


@dataclass(frozen=True)
class _Generation:
    """One completion, shared by the JSON and the SSE renderings so both aggregate to the same thing."""

    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    tokens: list[_Token]
    finish_reason: str
    reply: Reply
    logprobs: bool
    top_logprobs: int
    token_ids: bool
    index: int = 0  # the choice's index among a request's `n`
    forced_tools: bool = False  # `tool_choice` required or named: vLLM answers content "" beside the calls

    def tool_call_id(self, index: int) -> str:
        return "chatcmpl-tool-" + hashlib.sha256(f"{self.request_id}:{self.index}:{index}".encode()).hexdigest()[:16]

    def logprob_entry(self, token: _Token) -> dict[str, Any]:
        entry = {"token": token.text, "logprob": token.logprob, "bytes": list(token.text.encode())}
        top = [dict(entry)][: self.top_logprobs]
        for alt in range(1, self.top_logprobs):
            text = f"<alt{alt}>"
            top.append({"token": text, "logprob": round(token.logprob - alt, 6), "bytes": list(text.encode())})
        return {**entry, "top_logprobs": top}

    def message(self) -> dict[str, Any]:
        reasoning = "".join(t.text for t in self.tokens if t.kind == "reasoning")
        content = "".join(t.text for t in self.tokens if t.kind == "content")
        calls: list[dict[str, Any]] = []
        for token in (t for t in self.tokens if t.kind == "tool"):
            if token.first_of_call:
                name = self.reply.tool_calls[token.call].name
                calls.append({"id": self.tool_call_id(token.call), "type": "function",
                              "function": {"name": name, "arguments": ""}})
            calls[-1]["function"]["arguments"] += token.text
        message: dict[str, Any] = {
            "role": "assistant", "content": content if content or not calls or self.forced_tools else None,
            "refusal": None,
            "annotations": None, "audio": None, "function_call": None,
        }
        if calls:
            message["tool_calls"] = calls
        message["reasoning"] = reasoning or None
        return message

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": len(self.prompt_ids), "total_tokens": len(self.prompt_ids) + len(self.tokens),
                "completion_tokens": len(self.tokens)}

    def json_body(self) -> dict[str, Any]:
        body = _fixture_json("chat_response.json")  # the recorded key order and the fields we do not vary
        choice = body["choices"][0]
        body["id"] = self.request_id
        body["created"] = self.created
        body["model"] = self.model
        choice["index"] = self.index
        choice["message"] = self.message()
        choice["logprobs"] = ({"content": [self.logprob_entry(t) for t in self.tokens]} if self.logprobs else None)
        choice["finish_reason"] = self.finish_reason
        choice["stop_reason"] = None
        choice["token_ids"] = [t.id for t in self.tokens] if self.token_ids else None
        body["usage"] = {**self.usage(), "prompt_tokens_details": None, "completion_tokens_details": None}
        body["prompt_token_ids"] = self.prompt_ids if self.token_ids else None
        return body

    def _delta(self, token: _Token) -> dict[str, Any]:
        if token.kind == "reasoning":
            return {"reasoning": token.text}
        if token.kind == "content":
            return {"content": token.text}
        if token.first_of_call:
            name = self.reply.tool_calls[token.call].name
            return {"tool_calls": [{"index": token.call, "id": self.tool_call_id(token.call), "type": "function",
                                    "function": {"name": name, "arguments": token.text}}]}
        return {"tool_calls": [{"index": token.call, "function": {"arguments": token.text}}]}

    def sse_chunks(self, include_usage: bool) -> list[dict[str, Any] | str]:
        """The data payloads in order, exactly as chat_stream_response.sse lays them out; "[DONE]" last."""
        head = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
        chunks: list[dict[str, Any] | str] = [{
            **head,
            "choices": [{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}],
            "prompt_token_ids": self.prompt_ids if self.token_ids else None,
            "prompt_text": None,
        }]
        last = len(self.tokens) - 1
        for n, token in enumerate(self.tokens):
            choice: dict[str, Any] = {
                "index": self.index, "delta": self._delta(token),
                "logprobs": {"content": [self.logprob_entry(token)]} if self.logprobs else None,
                "finish_reason": self.finish_reason if n == last else None,
            }
            if n == last:
                choice["stop_reason"] = None
            choice["token_ids"] = [token.id] if self.token_ids else None
            chunks.append({**head, "choices": [choice]})
        if include_usage:
            chunks.append({**head, "choices": [], "usage": self.usage(),
                           "system_fingerprint": _fixture_json_cached("chat_response.json")["system_fingerprint"]})
        chunks.append("[DONE]")
        return chunks


@dataclass(frozen=True)
class _Choices:
    """The `n` > 1 choices of one request, laid out as vLLM 0.32 answers them: JSON with every choice (index 0 … n-1)
    and usage summed over them; SSE with one role chunk per choice (each carrying `prompt_token_ids`), then the
    choices' token chunks interleaved step by step (one choice per chunk, naming its index), each finishing once,
    then one usage chunk for all (chat_completion/serving.py `chat_completion_stream_generator`)."""

    generations: list[_Generation]

    def usage(self) -> dict[str, int]:
        prompt = len(self.generations[0].prompt_ids)
        completion = sum(len(g.tokens) for g in self.generations)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}

    def json_body(self) -> dict[str, Any]:
        bodies = [g.json_body() for g in self.generations]
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = {**self.usage(), "prompt_tokens_details": None, "completion_tokens_details": None}
        return body

    def sse_chunks(self, include_usage: bool) -> list[dict[str, Any] | str]:
        streams = [g.sse_chunks(False)[:-1] for g in self.generations]  # each without [DONE]
        chunks: list[dict[str, Any] | str] = [stream[0] for stream in streams]  # the role chunks first
        for step in range(1, max(len(stream) for stream in streams)):
            chunks += [stream[step] for stream in streams if step < len(stream)]
        if include_usage:
            first = self.generations[0]
            chunks.append({"id": first.request_id, "object": "chat.completion.chunk", "created": first.created,
                           "model": first.model, "choices": [], "usage": self.usage(),
                           "system_fingerprint": _fixture_json_cached("chat_response.json")["system_fingerprint"]})
        chunks.append("[DONE]")
        return chunks


_PLACEHOLDER = "@@bloat@@"
_BLOAT_BLOCK_BYTES = 1 << 16


class _Bloat:
    """A completion of about `total_bytes`, generated as it is written: the recorded shape (see `bloat_next`)."""

    def __init__(self, generation: "_Generation", total_bytes: int, status: int, include_usage: bool,
                 on_end: Callable[[int], None]) -> None:
        self._generation, self._total, self._status = generation, total_bytes, status
        self._include_usage, self._on_end = include_usage, on_end

    def response(self, stream: bool) -> Response:
        if self._status != 200:
            body = _error_body(self._status, _PLACEHOLDER)
            return self._stream(self._json(body, b"x"), "application/json")
        if stream:
            return self._stream(self._sse(), "text/event-stream")
        body = self._generation.json_body()
        token = self._generation.tokens[0]
        body["choices"][0]["message"]["content"] = _PLACEHOLDER  # one token's text repeated; the lists stay aligned
        return self._stream(self._json(body, token.text.encode()), "application/json")

    def _json(self, body: dict[str, Any], unit: bytes) -> list[tuple[bytes, int]]:
        """(bytes, repeats) pieces: the body with its placeholder string grown to the total size."""
        head, _, tail = orjson.dumps(body).partition(f'"{_PLACEHOLDER}"'.encode())
        count = max(1, (self._total - len(head) - len(tail)) // len(unit))
        return [(head + b'"', 1), (unit, count), (b'"' + tail, 1)]

    def _sse(self) -> list[tuple[bytes, int]]:
        chunks = self._generation.sse_chunks(self._include_usage)
        first, token_chunk = chunks[0], copy.deepcopy(chunks[1])
        token_chunk["choices"][0]["finish_reason"] = None
        unit = b"data: " + orjson.dumps(token_chunk) + b"\n\n"
        count = max(1, self._total // len(unit))
        for chunk in chunks:  # the usage chunk counts the repeated tokens too, as vLLM's would
            if isinstance(chunk, dict) and chunk.get("usage"):
                usage = chunk["usage"] = dict(chunk["usage"])
                usage["completion_tokens"] += count
                usage["total_tokens"] += count
        last = b"".join(b"data: " + (c.encode() if isinstance(c, str) else orjson.dumps(c)) + b"\n\n"
                        for c in chunks[1:])
        return [(b"data: " + orjson.dumps(first) + b"\n\n", 1), (unit, count), (last, 1)]

    def _stream(self, pieces: list[tuple[bytes, int]], media_type: str) -> Response:
        async def body() -> Any:
            sent = 0
            try:
                for unit, count in pieces:
                    per_block = max(1, _BLOAT_BLOCK_BYTES // len(unit))
                    while count > 0:
                        n = min(per_block, count)
                        block = unit * n
                        yield block
                        sent += len(block)
                        count -= n
                        await asyncio.sleep(0)  # a closed connection cancels this generator here
            finally:
                self._on_end(sent)

        return StreamingResponse(body(), status_code=self._status, media_type=media_type)


class _SSEResponse(Response):
    """Sends the chunks one by one; `drop_after` ends the exchange without the final empty body, so uvicorn closes
    the connection mid-stream (the client sees an incomplete chunked body, like a crashed upstream)."""

    media_type = "text/event-stream"

    def __init__(self, chunks: list[bytes], *, drop_after: int | None, chunk_delay_s: float) -> None:
        # Not Response.__init__: it would announce `content-length: 0`; a stream goes out chunked.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        self._chunks = chunks
        self._drop_after = drop_after
        self._chunk_delay_s = chunk_delay_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for n, chunk in enumerate(self._chunks):
            if self._drop_after is not None and n >= self._drop_after:
                return  # incomplete response: uvicorn drops the connection
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(self._chunk_delay_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error_type(status: int) -> str:
    return {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError", 429: "TooManyRequestsError",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError")


def _error_body(status: int, message: str, *, type_: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_ or _error_type(status), "param": param, "code": status}}


def _json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


# ---------------------------------------------------------------------------------------------------- the fake


class FakeVLLM:
    """See the module docstring."""

    def __init__(self, *, served_model: str = "tiny", name: str | None = None, port: int = 0,
                 max_loras: int | None = None) -> None:
        """`port`: 0 for a free one; a given port plays a vLLM that comes back at a known address. `max_loras`: refuse
        a load that would make the instance hold more adapters (vLLM 0.32 itself keeps registering past
        `--max-loras` and pages weights on its own; this strict fake proves the gateway keeps within its capacity)."""
        self.max_loras = max_loras
        self._peak_loaded = 0
        self.served_model = served_model
        self._name = name
        self.host = "127.0.0.1"
        self.port = port
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._requests: list[FakeRequest] = []
        self._chat_models: list[str] = []
        self._loras: dict[str, str] = {}  # lora name → path, in load order
        self._failures: dict[str, deque[tuple[int, Any, str]]] = {}
        self._delays: dict[str, deque[float]] = {}
        self._breaks: deque[int] = deque()
        self._bloats: deque[tuple[int, int]] = deque()
        self._bloat_sent: list[int] = []
        self._replies: deque[Reply] = deque()
        self._reply = Reply()
        self._model_replies: dict[str, Reply] = {}  # served model or LoRA name → its own reply
        self._responder: Callable[[dict[str, Any]], Reply] | None = None
        self._fail_loads = False
        self._chunk_delay_s = 0.0
        self._counter = 0
        self._version = 0  # bumped on every change `wait_until` may be waiting for
        self._closing = Gate()
        self._server: ThreadedServer | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def app(self) -> Starlette:
        """The fake's routes as an ASGI app: `start` serves it on a socket; a test that needs no socket (thousands
        of calls in process) reaches it through `httpx.ASGITransport`."""
        return Starlette(routes=[
            Route(CHAT_PATH, self._chat, methods=["POST"]),
            Route(LOAD_PATH, self._load, methods=["POST"]),
            Route(UNLOAD_PATH, self._unload, methods=["POST"]),
            Route(MODELS_PATH, self._models, methods=["GET"]),
            Route(HEALTH_PATH, self._health, methods=["GET"]),
        ])

    def start(self) -> FakeVLLM:
        self._closing = Gate()
        name = f"fake-vllm-{self._name or self.served_model}"
        self._server = ThreadedServer(self.app(), name=name, port=self.port).start()
        self.port = self._server.port
        if self._name is None:
            self._name = f"vllm-{self.served_model}-{self.port}"
        return self

    def stop(self) -> None:
        self._closing.open()
        if self._server is not None:
            self._server.stop()
        self._server = None

    async def astart(self) -> FakeVLLM:
        return await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    def __enter__(self) -> FakeVLLM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> FakeVLLM:
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        await self.astop()

    @property
    def name(self) -> str:
        return self._name or f"vllm-{self.served_model}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def registration(self) -> dict[str, Any]:
        """The `POST /aigw/v1/register-instance` body for this instance (§3.9)."""
        return {"name": self.name, "model": self.served_model, "instanceIp": self.host, "port": str(self.port),
                "role": "mixed", "groupID": "", "dpRank": -1}

    def instance_config(self) -> dict[str, Any]:
        """A static `instances[]` entry of the gateway config (§3.1)."""
        return {"name": self.name, "model": self.served_model, "instanceIp": self.host, "port": self.port}

    # -- scripting -------------------------------------------------------------------------------------------------

    @property
    def reply(self) -> Reply:
        with self._lock:
            return self._reply

    @reply.setter
    def reply(self, reply: Reply) -> None:
        with self._lock:
            self._reply = reply

    @property
    def responder(self) -> Callable[[dict[str, Any]], Reply] | None:
        with self._lock:
            return self._responder

    @responder.setter
    def responder(self, responder: Callable[[dict[str, Any]], Reply] | None) -> None:
        """Answer each chat request with `responder(body)` instead of `reply` (queued replies still come first): a
        fake model that follows the conversation, e.g. calls a tool, then answers from its result."""
        with self._lock:
            self._responder = responder

    def reply_for_model(self, model: str, reply: Reply) -> None:
        """Requests naming `model` (the base model or a LoRA name) get `reply` instead of `reply`, as a real adapter
        answers differently from the base model. Queued replies still come first."""
        with self._lock:
            self._model_replies[model] = reply

    def enqueue(self, *replies: Reply) -> None:
        """Replies for the next chat requests, in arrival order; then `reply` again."""
        with self._lock:
            self._replies.extend(replies)

    def fail_next(self, path: str, status: int, body: Any = None, times: int = 1,
                  content_type: str = "application/json") -> None:
        """The next `times` requests to `path` answer `status` with `body` (str, bytes or JSON; default a vLLM error
        envelope) labelled `content_type` (a rogue instance may answer `text/html`), and have no other effect."""
        with self._lock:
            self._failures.setdefault(path, deque()).extend([(status, body, content_type)] * times)

    def delay_next(self, path: str, seconds: float, times: int = 1) -> None:
        """The next `times` requests to `path` wait `seconds` before doing anything (cut short by `stop()`)."""
        with self._lock:
            self._delays.setdefault(path, deque()).extend([seconds] * times)

    def break_stream_after(self, n_chunks: int) -> None:
        """The next streamed completion sends `n_chunks` data chunks, then the connection drops."""
        with self._lock:
            self._breaks.append(n_chunks)

    def bloat_next(self, total_bytes: int, status: int = 200) -> None:
        """The next chat answer is about `total_bytes` long, written as it is generated (chunked; never held whole):
        JSON, the recorded shape whose reply is one token's text repeated; SSE, the recorded chunks with one token
        chunk repeated, then the usage chunk and `[DONE]`; with another `status`, vLLM's error envelope with a long
        message. `bloat_sent` records the bytes each such answer got out before it ended or its reader left."""
        with self._lock:
            self._bloats.append((total_bytes, status))

    @property
    def bloat_sent(self) -> list[int]:
        with self._lock:
            return list(self._bloat_sent)

    def _bloat_ended(self, sent: int) -> None:
        with self._changed:
            self._bloat_sent.append(sent)
            self._notify()

    @property
    def fail_loads(self) -> bool:
        with self._lock:
            return self._fail_loads

    @fail_loads.setter
    def fail_loads(self, value: bool) -> None:
        with self._lock:
            self._fail_loads = value

    @property
    def stream_chunk_delay_s(self) -> float:
        with self._lock:
            return self._chunk_delay_s

    @stream_chunk_delay_s.setter
    def stream_chunk_delay_s(self, value: float) -> None:
        with self._lock:
            self._chunk_delay_s = value

    def preload(self, lora_name: str, lora_path: str) -> None:
        """Hold an adapter without a load request (e.g. loaded before a gateway restart)."""
        with self._changed:
            self._loras[lora_name] = lora_path
            self._notify()

    def drop_loras(self) -> None:
        """Forget every adapter, as a restarted vLLM would."""
        with self._changed:
            self._loras.clear()
            self._notify()

    # -- inspection ------------------------------------------------------------------------------------------------

    @property
    def requests(self) -> list[FakeRequest]:
        with self._lock:
            return list(self._requests)

    def count(self, path: str) -> int:
        with self._lock:
            return sum(1 for r in self._requests if r.path == path)

    @property
    def loaded(self) -> set[str]:
        with self._lock:
            return set(self._loras)

    @property
    def peak_loaded(self) -> int:
        """The most adapters held at once since start."""
        with self._lock:
            return self._peak_loaded

    @property
    def loaded_paths(self) -> dict[str, str]:
        with self._lock:
            return dict(self._loras)

    @property
    def chat_models(self) -> list[str]:
        with self._lock:
            return list(self._chat_models)

    def clear(self) -> None:
        """Forget the records and the scripted controls (adapters and the default reply stay)."""
        with self._lock:
            self._requests.clear()
            self._chat_models.clear()
            self._failures.clear()
            self._delays.clear()
            self._breaks.clear()
            self._bloats.clear()
            self._replies.clear()

    def wait_until(self, predicate: Callable[[FakeVLLM], bool], timeout_s: float = 5.0) -> None:
        """Block until `predicate(self)` holds (re-checked after every request and adapter change)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                seen = self._version
            if predicate(self):
                return
            with self._changed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"condition not met on {self.name} within {timeout_s} s")
                self._changed.wait_for(lambda: self._version != seen, left)

    def _notify(self) -> None:
        """Call with the lock held."""
        self._version += 1
        self._changed.notify_all()

    async def wait_until_async(self, predicate: Callable[[FakeVLLM], bool], timeout_s: float = 5.0) -> None:
        await asyncio.to_thread(self.wait_until, predicate, timeout_s)

    # -- serving ---------------------------------------------------------------------------------------------------

    async def _receive(self, request: Request) -> tuple[FakeRequest, Response | None]:
        """Record the request, apply its scripted delay and failure; a Response means "answer this"."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        received = FakeRequest(request.method, request.url.path, body,
                               {k.lower(): v for k, v in request.headers.items()})
        path = received.path
        with self._changed:
            self._requests.append(received)
            delays = self._delays.get(path)
            delay = delays.popleft() if delays else None
            self._notify()
        if delay is not None and await self._closing.wait(delay):
            return received, _json_response(_error_body(503, "fake vLLM stopping"), 503)
        with self._lock:
            failures = self._failures.get(path)
            failure = failures.popleft() if failures else None
        if failure is not None:
            status, fail_body, content_type = failure
            if fail_body is None:
                fail_body = _error_body(status, f"scripted failure of {path}")
            if not isinstance(fail_body, (bytes, str)):
                fail_body = orjson.dumps(fail_body)
            return received, Response(fail_body, status_code=status, media_type=content_type)
        return received, None

    async def _health(self, request: Request) -> Response:
        _, answer = await self._receive(request)
        return answer or Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        _, answer = await self._receive(request)
        if answer is not None:
            return answer
        now = int(time.time())
        base = _fixture_json("models_base.json")["data"][0]
        base.update(id=self.served_model, created=now, root=f"/models/{self.served_model}")
        base["permission"][0].update(id=self._perm_id(self.served_model), created=now)
        data = [base]
        template = _fixture_json_cached("models_with_lora.json")["data"][1]
        for name, path in self.loaded_paths.items():
            entry = copy.deepcopy(template)
            entry.update(id=name, created=now, root=path, parent=self.served_model)
            entry["permission"][0].update(id=self._perm_id(name), created=now)
            data.append(entry)
        return _json_response({"object": "list", "data": data})

    def _perm_id(self, model: str) -> str:
        return "modelperm-" + hashlib.sha256(f"{self.name}:{model}".encode()).hexdigest()[:16]

    async def _load(self, request: Request) -> Response:
        received, answer = await self._receive(request)
        if answer is not None:
            return answer
        body = received.body if isinstance(received.body, dict) else {}
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _json_response(_error_body(400, "Both 'lora_name' and 'lora_path' must be provided.",
                                              type_="InvalidUserInput"), 400)
        if self.fail_loads:
            return _json_response(_error_body(500, f"Loading lora {name} failed: scripted failure"), 500)
        with self._changed:
            if name in self._loras and not body.get("load_inplace"):
                error, status = _recorded_error("load_lora_again.txt")
                error["error"]["message"] = error["error"]["message"].replace("tiny:v1", name)
                return _json_response(error, status)
            if not os.path.isdir(path):
                error, status = _recorded_error("load_lora_missing_path.txt")
                error["error"]["message"] = f"Loading lora {name} failed: No adapter found for {path}"
                return _json_response(error, status)
            if self.max_loras is not None and len(self._loras) >= self.max_loras:
                return _json_response(_error_body(
                    400, f"Loading lora {name} failed: {len(self._loras)} adapters loaded, max_loras is "
                    f"{self.max_loras}", type_="BadRequestError"), 400)
            self._loras[name] = path
            self._peak_loaded = max(self._peak_loaded, len(self._loras))
            self._notify()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: Request) -> Response:
        received, answer = await self._receive(request)
        if answer is not None:
            return answer
        body = received.body if isinstance(received.body, dict) else {}
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return _json_response(_error_body(400, "either 'lora_name' or 'lora_int_id' needs to be provided.",
                                              type_="InvalidUserInput"), 400)
        with self._changed:
            if self._loras.pop(name, None) is None:
                error, status = _recorded_error("unload_lora_again.txt")
                error["error"]["message"] = f"The lora adapter '{name}' cannot be found."
                return _json_response(error, status)
            self._notify()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _chat(self, request: Request) -> Response:
        received, answer = await self._receive(request)
        body = received.body
        model = body.get("model") if isinstance(body, dict) else None
        model = model if isinstance(model, str) and model else self.served_model
        with self._changed:
            self._chat_models.append(model)
            self._notify()
        if answer is not None:
            return answer
        if not isinstance(body, dict):
            return _json_response(_error_body(400, "request body must be a JSON object"), 400)
        with self._lock:
            known = model == self.served_model or model in self._loras
        if not known:
            error, status = _recorded_error("error_unknown_model.txt")
            error["error"]["message"] = f"The model `{model}` does not exist. Valid aliases: {self.served_model}."
            return _json_response(error, status)
        prompt_ids = prompt_token_ids(body.get("messages"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = MAX_MODEL_LEN - len(prompt_ids)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            return _json_response(_error_body(400, f"max_tokens must be at least 1, got {max_tokens}.",
                                              param="max_tokens"), 400)
        if max_tokens > MAX_MODEL_LEN:
            error, status = _recorded_error("error_too_long.txt")
            error["error"]["message"] = (
                f"max_tokens={max_tokens} cannot be greater than max_model_len={MAX_MODEL_LEN}. Please request "
                f"fewer output tokens. (parameter=max_tokens, value={max_tokens})")
            return _json_response(error, status)
        top = body.get("top_logprobs")
        if isinstance(top, int) and (top == -1 or top > 0) and not body.get("logprobs"):  # check_logprobs
            return _json_response(_error_body(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                                              param="top_logprobs"), 400)
        n = body.get("n")
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return _json_response(_error_body(400, f"n must be at least 1, got {n}."), 400)
        if n > 1 and body.get("temperature") == 0:  # SamplingParams._verify_greedy_sampling
            return _json_response(_error_body(400, f"n must be 1 when using greedy sampling, got {n}."), 400)
        generation = self._generate(body, model, prompt_ids, max_tokens)
        if n > 1:  # each further choice draws the next reply, as the first did
            generation = _Choices([generation] + [
                dataclasses.replace(self._generate(body, model, prompt_ids, max_tokens),
                                    request_id=generation.request_id, created=generation.created, index=i)
                for i in range(1, n)])
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        with self._lock:
            bloat = self._bloats.popleft() if self._bloats and isinstance(generation, _Generation) else None
        if bloat is not None:
            total, status = bloat
            bloated = _Bloat(generation, total, status, include_usage, self._bloat_ended)
            return bloated.response(stream=bool(body.get("stream")))
        if not body.get("stream"):
            return _json_response(generation.json_body())
        chunks = [b"data: " + (c.encode() if isinstance(c, str) else orjson.dumps(c)) + b"\n\n"
                  for c in generation.sse_chunks(include_usage)]
        with self._lock:
            drop_after = self._breaks.popleft() if self._breaks else None
            delay_s = self._chunk_delay_s
        return _SSEResponse(chunks, drop_after=drop_after, chunk_delay_s=delay_s)

    def _generate(self, body: dict[str, Any], model: str, prompt_ids: list[int], max_tokens: int) -> _Generation:
        with self._lock:
            queued = self._replies.popleft() if self._replies else None
            reply = queued or self._model_replies.get(model, self._reply)
            responder = self._responder if queued is None else None
            self._counter += 1
            counter = self._counter
        if responder is not None:
            reply = responder(body)
        tokens = _tokens(reply)
        cut = len(tokens) > max_tokens
        tokens = tokens[:max_tokens]
        if cut:
            finish = "length"
        elif reply.finish_reason is not None:
            finish = reply.finish_reason
        else:
            named = isinstance(body.get("tool_choice"), dict)  # a named tool choice ends with "stop" in vLLM 0.32
            finish = "tool_calls" if any(t.kind == "tool" for t in tokens) and not named else "stop"
        top = body.get("top_logprobs")
        forced = body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict)
        return _Generation(
            request_id="chatcmpl-" + hashlib.sha256(f"{self.name}:{counter}".encode()).hexdigest()[:16],
            created=int(time.time()), model=model, prompt_ids=prompt_ids, tokens=tokens, finish_reason=finish,
            reply=reply, logprobs=body.get("logprobs") is True,
            top_logprobs=top if isinstance(top, int) and not isinstance(top, bool) and top > 0 else 0,
            token_ids=body.get("return_token_ids") is True, forced_tools=forced and bool(reply.tool_calls),
        )

