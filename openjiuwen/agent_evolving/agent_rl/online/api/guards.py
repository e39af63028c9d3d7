"""Pure ASGI guards run before routing, in the contract's order: bearer auth, then body size (CONTRACT §2.1).

Before both: a request that arrived on a non-loopback local address is refused. `main()` never binds one
(`listen_host` is loopback-only), but the uvicorn factory (`uvicorn --factory … --host 0.0.0.0`) binds what its
command line says; this keeps the service loopback-only there too.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import PayloadTooLarge, envelope_bytes

_UNAUTHENTICATED_PATHS = frozenset({"/health"})


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
                await _send_error(send, 413, "payload_too_large", f"request body exceeds {self._max} bytes")
                return
            await self.app(scope, receive, send)
            return
        await self._chunked(scope, receive, send)

    async def _chunked(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._max:
                    raise PayloadTooLarge(self._max)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except PayloadTooLarge:  # normally answered by the envelope handler; this catches reads outside routes
            if not response_started:
                await _send_error(send, 413, "payload_too_large", f"request body exceeds {self._max} bytes")
