"""A fake OpenAI-compatible Judge on a real loopback socket, scripted per request.

It serves `POST /v1/chat/completions` from uvicorn in a background thread on a free 127.0.0.1 port (other paths
answer 404 and are not recorded). Every received request is recorded; each one takes the next scripted behaviour
from a FIFO queue, or the default behaviour when the queue is empty (a verdict with overall 8).

    from tests.support.fake_judge import Content, Delay, FakeJudge, Hold, Raw, Status, Truncated, Verdict

    with FakeJudge() as judge:                         # sync tests; `async with FakeJudge() as judge:` in async ones
        judge.enqueue(Status(503), Verdict(6))         # first request: 503, second: overall 6, then the default
        scorer = JudgeScorer(endpoint=judge.url, model="judge", api_key="k")
        ...
        assert judge.requests[0].authorization == "Bearer k"
        assert "[user] hi" in judge.requests[0].prompt

    judge.default = Verdict(3)                         # replaces the default behaviour (any thread, any time)
    judge.default = lambda req: Verdict(9 if "good" in req.prompt else 2)   # per-request choice, order-free

    gate = judge.gate()                                # hold replies until the test says so, without sleeps
    judge.enqueue(Hold(gate, then=Verdict(7)))
    ...; judge.wait_for_requests(1); gate.open()       # or `await judge.wait_for_requests_async(1)`

Behaviours: `Verdict` (a JSON verdict), `Content` (any content text and finish_reason), `Truncated` (garbage with
`finish_reason="length"`), `Status` (an HTTP error with an OpenAI error body), `Raw` (any status and body, e.g. not
JSON or without choices), `Delay` (wait, then another behaviour), `Hold` (wait for a `Gate`, then another behaviour),
or a callable taking the `ReceivedRequest` and returning one of these. Thread-safe: the queue, the default and the
records are guarded by one lock; stopping opens every gate and ends every delay, so `stop()` never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support.asgi_server import ThreadedServer

CHAT_PATH = "/v1/chat/completions"


class Gate:
    """A latch opened from any thread; fake replies wait on it on the server's loop without blocking it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._opened

    def open(self) -> None:
        with self._lock:
            self._opened = True
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting any more
                loop.call_soon_threadsafe(_resolve, future)

    async def wait(self, timeout_s: float | None = None) -> bool:
        """True once open; False when `timeout_s` passes first."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._opened:
                return True
            future: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, future))
        try:
            await asyncio.wait_for(future, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                if (loop, future) in self._waiters:
                    self._waiters.remove((loop, future))


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(frozen=True)
class Verdict:
    """A 200 whose content is a JSON verdict: `dims` (e.g. {"coherence_score": 6}), then `overall` unless None."""

    overall: float | None = 8.0
    dims: Mapping[str, Any] = field(default_factory=dict)
    reason: str = "fake judge"

    def content(self) -> str:
        verdict: dict[str, Any] = dict(self.dims)
        if self.overall is not None:
            verdict["overall"] = self.overall
        verdict["reason"] = self.reason
        return json.dumps(verdict)


@dataclass(frozen=True)
class Content:
    """A 200 chat.completion with this exact content text and finish_reason."""

    text: str
    finish_reason: str = "stop"


@dataclass(frozen=True)
class Truncated:
    """A 200 cut off by the token limit: unparsable content with `finish_reason="length"`."""

    text: str = '{"task_completion": 7, "response_quality'


@dataclass(frozen=True)
class Status:
    """An HTTP error with an OpenAI-style error body."""

    code: int
    message: str = "fake judge error"


@dataclass(frozen=True)
class Raw:
    """Any status and raw body, e.g. not JSON (the default) or `b'{"choices": []}'`."""

    body: bytes = b"<html>this is not json</html>"
    status: int = 200
    content_type: str = "application/json"


@dataclass(frozen=True)
class Delay:
    """Wait `seconds` (cut short when the fake stops), then behave as `then`."""

    seconds: float
    then: Behaviour = field(default_factory=Verdict)


@dataclass(frozen=True)
class Hold:
    """Wait until `gate` opens (or `timeout_s` passes, or the fake stops), then behave as `then`."""

    gate: Gate
    then: Behaviour = field(default_factory=Verdict)
    timeout_s: float = 30.0


Behaviour = Verdict | Content | Truncated | Status | Raw | Delay | Hold | Callable[["ReceivedRequest"], Any]


@dataclass(frozen=True)
class ReceivedRequest:
    """One request as the fake received it. `headers` keys are lower-case."""

    path: str
    headers: dict[str, str]
    raw: bytes
    body: Any  # the decoded JSON, or None when the body was not JSON

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")

    @property
    def prompt(self) -> str:
        """The content of the first message: the judge prompt as JudgeScorer sends it ("" when absent)."""
        try:
            content = self.body["messages"][0]["content"]
        except (KeyError, IndexError, TypeError):
            return ""
        return content if isinstance(content, str) else ""


class FakeJudge:
    """See the module docstring. `url` is the base URL; `chat_url` the full chat-completions URL."""

    def __init__(self, *, default: Behaviour | None = None) -> None:
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._queue: deque[Behaviour] = deque()
        self._default: Behaviour = default if default is not None else Verdict()
        self._requests: list[ReceivedRequest] = []
        self._gates: list[Gate] = []
        self._closing = Gate()  # opened by stop(): ends every Delay and Hold at once
        self._server: ThreadedServer | None = None
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> FakeJudge:
        self._closing = Gate()  # a fresh one, so a restarted fake does not cut its delays short
        app = Starlette(routes=[Route(CHAT_PATH, self._chat, methods=["POST"])])
        self._server = ThreadedServer(app, name="fake-judge").start()
        self.port = self._server.port
        return self

    def stop(self) -> None:
        self._closing.open()
        with self._lock:
            gates = list(self._gates)
        for gate in gates:
            gate.open()
        if self._server is not None:
            self._server.stop()
        self._server = None

    def __enter__(self) -> FakeJudge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> FakeJudge:
        return await asyncio.to_thread(self.start)  # start() waits; keep the test's loop free meanwhile

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    # -- scripting and inspection ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def chat_url(self) -> str:
        return self.url + CHAT_PATH

    @property
    def default(self) -> Behaviour:
        with self._lock:
            return self._default

    @default.setter
    def default(self, behaviour: Behaviour) -> None:
        with self._lock:
            self._default = behaviour

    def enqueue(self, *behaviours: Behaviour) -> None:
        """Script the next requests, in arrival order; the default applies once these are used up."""
        with self._lock:
            self._queue.extend(behaviours)

    @property
    def pending(self) -> int:
        """Scripted behaviours not yet used."""
        with self._lock:
            return len(self._queue)

    def gate(self) -> Gate:
        """A new Gate for `Hold`; the fake opens it when it stops, so a forgotten gate cannot hang a test."""
        gate = Gate()
        with self._lock:
            self._gates.append(gate)
        return gate

    @property
    def requests(self) -> list[ReceivedRequest]:
        """A snapshot of every chat request received so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    def clear(self) -> None:
        """Forget recorded requests and scripted behaviours (the default stays)."""
        with self._lock:
            self._requests.clear()
            self._queue.clear()

    def wait_for_requests(self, count: int, timeout_s: float = 5.0) -> list[ReceivedRequest]:
        """Block until at least `count` requests arrived; raises TimeoutError after `timeout_s`."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self._requests) >= count, timeout_s):
                raise TimeoutError(f"fake judge got {len(self._requests)} of {count} requests in {timeout_s} s")
            return list(self._requests)

    async def wait_for_requests_async(self, count: int, timeout_s: float = 5.0) -> list[ReceivedRequest]:
        return await asyncio.to_thread(self.wait_for_requests, count, timeout_s)

    # -- serving ----------------------------------------------------------------------------------------------------

    async def _chat(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        received = ReceivedRequest(path=request.url.path, headers={k.lower(): v for k, v in request.headers.items()},
                                   raw=raw, body=body)
        with self._arrived:
            self._requests.append(received)
            behaviour = self._queue.popleft() if self._queue else self._default
            self._arrived.notify_all()
        return await self._perform(behaviour, received)

    async def _perform(self, behaviour: Behaviour, received: ReceivedRequest) -> Response:
        if isinstance(behaviour, Delay):
            if await self._closing.wait(behaviour.seconds):
                return _error(503, "fake judge stopping")
            return await self._perform(behaviour.then, received)
        if isinstance(behaviour, Hold):
            await _first_of(behaviour.gate, self._closing, timeout_s=behaviour.timeout_s)
            return await self._perform(behaviour.then, received)
        if isinstance(behaviour, Verdict):
            return _completion(received, behaviour.content(), "stop")
        if isinstance(behaviour, Content):
            return _completion(received, behaviour.text, behaviour.finish_reason)
        if isinstance(behaviour, Truncated):
            return _completion(received, behaviour.text, "length")
        if isinstance(behaviour, Status):
            return _error(behaviour.code, behaviour.message)
        if isinstance(behaviour, Raw):
            return Response(behaviour.body, status_code=behaviour.status, media_type=behaviour.content_type)
        if callable(behaviour):
            return await self._perform(behaviour(received), received)
        raise TypeError(f"not a fake judge behaviour: {behaviour!r}")


async def _first_of(*gates: Gate, timeout_s: float) -> None:
    waits = [asyncio.ensure_future(gate.wait(timeout_s)) for gate in gates]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def _completion(received: ReceivedRequest, content: str, finish_reason: str) -> Response:
    model = received.body.get("model", "fake-judge") if isinstance(received.body, dict) else "fake-judge"
    return JSONResponse({
        "id": "chatcmpl-fake-judge",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": finish_reason,
        }],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })


def _error(code: int, message: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": "fake_judge_error", "code": code}}, status_code=code)
