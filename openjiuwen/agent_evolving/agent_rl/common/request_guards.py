"""Pure ASGI guards run before routing, in the contract's order: bearer auth, then body size (CONTRACT §2.1).

Before both: a request that arrived on a non-loopback local address is refused. `main()` never binds one
(`listen_host` is loopback-only), but the uvicorn factory (`uvicorn --factory … --host 0.0.0.0`) binds what its
command line says; this keeps the service loopback-only there too.

A body over the limit is answered 413 `payload_too_large` with `Connection: close`, and the rest of the body is then
read and discarded (at most DRAIN_SECONDS, DRAIN_IDLE_SECONDS between reads, DRAIN_BYTES) before the connection
closes. Closing at once would leave the unread body in the socket, and the kernel would answer the client's next
segments with a reset: a client that writes the whole body before reading (Python's urllib, many SDKs) would see
BrokenPipeError or ConnectionResetError instead of the 413.
"""

from __future__ import annotations

import asyncio
import hmac
from enum import Enum

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import loopback
from .errors import PayloadTooLarge, envelope_bytes

_UNAUTHENTICATED_PATHS = frozenset({"/health"})
# Reading the rest of an over-limit body (see the module docstring): total time, longest pause between two reads,
# bytes. A client still sending after these gets the connection closed under it.
DRAIN_SECONDS = 10.0
DRAIN_IDLE_SECONDS = 2.0
DRAIN_BYTES = 256 * 1024 * 1024


async def _send_error(send: Send, status: int, code: str, message: str) -> None:
    body = envelope_bytes(code, message)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _closing(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() != b"connection"] + [(b"connection", b"close")]


async def _drain(receive: Receive) -> int:
    """Read and discard what is left of the request body, within the DRAIN_* bounds; returns the bytes read."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DRAIN_SECONDS
    drained = 0
    while drained < DRAIN_BYTES:
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        try:
            async with asyncio.timeout(min(remaining, DRAIN_IDLE_SECONDS)):
                message = await receive()
        except TimeoutError:
            break
        if message["type"] != "http.request":  # the client went away
            break
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return drained


class TooLargeAnswer:
    """Sends a 413 (ours or the app's) with `Connection: close` and, when the client may still be writing the body,
    holds the end of the response until the rest of the body is drained: the whole answer is on the wire first (it
    carries its Content-Length), so a client reading while it writes has it at once; the server then closes only
    once the body is read, or its bound is reached."""

    def __init__(self, send: Send, receive: Receive, *, drain: bool) -> None:
        self._send, self._receive, self._drain = send, receive, drain

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": _closing(list(message.get("headers") or []))}
        elif message["type"] == "http.response.body" and not message.get("more_body", False) and self._drain:
            self._drain = False
            await self._send({**message, "more_body": True})
            await _drain(self._receive)
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await self._send(message)


def _arrived_on_loopback(scope: Scope) -> bool:
    """False only when the local address the connection arrived on is a non-loopback IP (common/loopback.py). Unix
    sockets and in-process transports (no address, or a host name such as a test client's) are local by
    construction."""
    server = scope.get("server")
    if not server:
        return True
    host = str(server[0]).split("%", 1)[0]  # a link-local listener's scope id says nothing about loopback
    return loopback.ip_literal(host) is None or loopback.is_loopback_ip(host)


class Admission(Enum):
    """What `RequestGuard.admit` decided."""

    REFUSED = "refused"  # answered already: 403, 401, 400 (Content-Length), 413
    SIZED = "sized"  # passes, with a Content-Length within the limit
    UNSIZED = "unsized"  # passes without a Content-Length: count the body while reading it (`BodyCounter`)


class RequestGuard:
    """The checks of GuardMiddleware, in the contract's order, for any ASGI path that answers before the app's
    routing (the RL Service's hook fast path, online/api/hook_fast_path.py, runs them as the middleware does)."""

    def __init__(self, *, token: str | None, max_body_bytes: int, loopback_only: bool = True) -> None:
        self.loopback_only = loopback_only  # the RL Service; the gateway serves the network and passes False
        self._token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes

    async def admit(self, scope: Scope, receive: Receive, send: Send) -> Admission:
        """Loopback, bearer token on every route but `GET /health` (when a token is set), then the declared body
        size; a refusal is answered on `send` here."""
        if self.loopback_only and not _arrived_on_loopback(scope):
            await _send_error(send, 403, "forbidden", "the RL Service serves loopback clients only")
            return Admission.REFUSED
        headers = dict(scope.get("headers") or [])
        if self._token is not None and not (scope["method"] == "GET" and scope["path"] in _UNAUTHENTICATED_PATHS):
            presented = headers.get(b"authorization", b"")
            expected = b"Bearer " + self._token
            if not hmac.compare_digest(presented, expected):
                await _send_error(send, 401, "unauthorized", "missing or invalid bearer token")
                return Admission.REFUSED
        length = headers.get(b"content-length")
        if length is None:
            return Admission.UNSIZED
        try:
            too_large = int(length) > self.max_body_bytes
        except ValueError:
            await _send_error(send, 400, "invalid_request", "invalid Content-Length")
            return Admission.REFUSED
        if too_large:
            # No byte of the body was read; a client that waits for `100 Continue` sends none, and asking for
            # the body would make the server send that interim answer after this final one.
            drain = headers.get(b"expect", b"").lower() != b"100-continue"
            await _send_error(TooLargeAnswer(send, receive, drain=drain), 413, "payload_too_large",
                              f"request body exceeds {self.max_body_bytes} bytes")
            return Admission.REFUSED
        return Admission.SIZED


class BodyCounter:
    """Counts an unsized (chunked) body as its messages are read. Past the limit it raises PayloadTooLarge and
    keeps in `over` how the answer must go out (413 with `Connection: close`, then the rest drained)."""

    def __init__(self, limit: int, send: Send, receive: Receive) -> None:
        self._limit, self._send, self._receive = limit, send, receive
        self.received = 0
        self.over: TooLargeAnswer | None = None

    def add(self, message: Message) -> None:
        """Count one `http.request` message."""
        self.received += len(message.get("body", b""))
        if self.received > self._limit:
            self.over = TooLargeAnswer(self._send, self._receive, drain=bool(message.get("more_body", False)))
            raise PayloadTooLarge(self._limit)


class GuardMiddleware:
    """Bearer token on every route but `GET /health` (when a token is set), then the body limit: decided from
    Content-Length before reading, or while reading a chunked body."""

    def __init__(self, app: ASGIApp, *, token: str | None, max_body_bytes: int, loopback_only: bool = True) -> None:
        self.app = app
        self._guard = RequestGuard(token=token, max_body_bytes=max_body_bytes, loopback_only=loopback_only)
        self._max = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admission = await self._guard.admit(scope, receive, send)
        if admission is Admission.REFUSED:
            return
        if admission is Admission.SIZED:
            await self.app(scope, receive, send)
            return
        await self._chunked(scope, receive, send)

    async def _chunked(self, scope: Scope, receive: Receive, send: Send) -> None:
        counter = BodyCounter(self._max, send, receive)  # `over` set once the body went past the limit
        response_started = False

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                counter.add(message)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            # The route's handler answers PayloadTooLarge (the envelope handler); that answer closes the connection.
            await (counter.over or send)(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except PayloadTooLarge:  # normally answered by the envelope handler; this catches reads outside routes
            if not response_started:
                await _send_error(counter.over or send, 413, "payload_too_large",
                                  f"request body exceeds {self._max} bytes")
