"""Request bodies must be JSON: a pure ASGI guard shared by the RL Service and the gateway.

Every route of both takes JSON or nothing. A body whose `Content-Type` is not `application/json` or a `+json` type
(absent included) is refused with 415 `unsupported_media_type` before any route reads it. That closes the
cross-site door a browser leaves open: a page on any origin may POST `text/plain`, form-encoded or untyped bodies to
a loopback port without a CORS preflight, but never a JSON one. A request without a body (no `Content-Length`, or
`Content-Length: 0`, and no `Transfer-Encoding`) is let through whatever its type, so bodiless control calls keep
working unchanged.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import envelope_bytes

_BODY = envelope_bytes("unsupported_media_type",
                       "a request body must be JSON: send it with Content-Type: application/json")


def media_type(value: bytes) -> bytes:
    """A `Content-Type` value without its parameters (`; charset=utf-8`), lower-cased."""
    return value.split(b";", 1)[0].strip().lower()


def is_json_media_type(value: bytes) -> bool:
    """`application/json` or `application/<anything>+json`, parameters (`; charset=utf-8`) allowed."""
    media = media_type(value)
    kind, slash, subtype = media.partition(b"/")
    return kind == b"application" and bool(slash) and (subtype == b"json" or (subtype.endswith(b"+json")
                                                                             and len(subtype) > 5))


def declares_body(headers: dict[bytes, bytes]) -> bool:
    if b"transfer-encoding" in headers:
        return True
    length = headers.get(b"content-length")
    return length is not None and length.strip() not in (b"", b"0")


class BodyTypeGuard:
    """The check of JsonBodyMiddleware, for any ASGI path that answers before the app's routing (the RL Service's
    hook fast path, online/api/hook_fast_path.py, runs it as the middleware does).

    `binary_routes`: path → the one non-JSON media type that path also takes (the RL Service's packed `:after`,
    common/packed_hook.py). Such a type is no CORS-safelisted one, so a browser preflights it: the door stays shut."""

    def __init__(self, binary_routes: dict[str, str] | None = None) -> None:
        self._binary = {path: media.encode() for path, media in (binary_routes or {}).items()}

    def refuses(self, scope: Scope) -> bool:
        """True when the request declares a body whose type the path does not take (answer `send_unsupported`)."""
        headers: dict[bytes, bytes] = {}
        for name, value in scope.get("headers") or ():
            headers.setdefault(name.lower(), value)  # the first of a repeated header, as routes read it
        media = headers.get(b"content-type", b"")
        return (declares_body(headers) and not is_json_media_type(media)
                and media_type(media) != self._binary.get(scope.get("path", "")))


async def send_unsupported(send: Send) -> None:
    """The 415 `unsupported_media_type` answer."""
    await send({"type": "http.response.start", "status": 415, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode())]})
    await send({"type": "http.response.body", "body": _BODY})


class JsonBodyMiddleware:
    """415 for a declared body that is not JSON (nor the path's binary type, see BodyTypeGuard)."""

    def __init__(self, app: ASGIApp, *, binary_routes: dict[str, str] | None = None) -> None:
        self.app = app
        self._guard = BodyTypeGuard(binary_routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guard.refuses(scope):
            await send_unsupported(send)
            return
        await self.app(scope, receive, send)
