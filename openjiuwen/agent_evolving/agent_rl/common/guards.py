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
import ipaddress

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


class _TooLargeAnswer:
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
    """False only when the local address the connection arrived on is a non-loopback IP. Unix sockets and
    in-process transports (no address, or a host name such as a test client's) are local by construction."""
    server = scope.get("server")
    if not server:
        return True
    try:
        address = ipaddress.ip_address(str(server[0]).split("%", 1)[0])
    except ValueError:
        return True
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class GuardMiddleware:
    """Bearer token on every route but `GET /health` (when a token is set), then the body limit: decided from
    Content-Length before reading, or while reading a chunked body."""

    def __init__(self, app: ASGIApp, *, token: str | None, max_body_bytes: int, loopback_only: bool = True) -> None:
        self.app = app
        self._loopback_only = loopback_only  # the RL Service; the gateway serves the network and passes False
        self._token = token.encode() if token else None
        self._max = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._loopback_only and not _arrived_on_loopback(scope):
            await _send_error(send, 403, "forbidden", "the RL Service serves loopback clients only")
            return
        headers = dict(scope.get("headers") or [])
        if self._token is not None and not (scope["method"] == "GET" and scope["path"] in _UNAUTHENTICATED_PATHS):
            presented = headers.get(b"authorization", b"")
            expected = b"Bearer " + self._token
            if not hmac.compare_digest(presented, expected):
                await _send_error(send, 401, "unauthorized", "missing or invalid bearer token")
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_large = int(length) > self._max
            except ValueError:
                await _send_error(send, 400, "invalid_request", "invalid Content-Length")
                return
            if too_large:
                # No byte of the body was read; a client that waits for `100 Continue` sends none, and asking for
                # the body would make the server send that interim answer after this final one.
                drain = headers.get(b"expect", b"").lower() != b"100-continue"
                await _send_error(_TooLargeAnswer(send, receive, drain=drain), 413, "payload_too_large",
                                  f"request body exceeds {self._max} bytes")
                return
            await self.app(scope, receive, send)
            return
        await self._chunked(scope, receive, send)

    async def _chunked(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = 0
        over: _TooLargeAnswer | None = None  # set once the body went past the limit: how the answer is sent
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._max:
                    over = _TooLargeAnswer(send, receive, drain=bool(message.get("more_body", False)))
                    raise PayloadTooLarge(self._max)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            # The route's handler answers PayloadTooLarge (the envelope handler); that answer closes the connection.
            await (over or send)(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except PayloadTooLarge:  # normally answered by the envelope handler; this catches reads outside routes
            if not response_started:
                await _send_error(over or send, 413, "payload_too_large", f"request body exceeds {self._max} bytes")
