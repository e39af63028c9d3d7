"""Browser hardening headers on every gateway answer (issue 19 item 5).

The gateway answers JSON, SSE and Prometheus text; only the console pages are meant to be rendered by a browser, and
they set their own policy (scripts, styles and fetches from the gateway only; console/console.py). Every other answer
gets `X-Content-Type-Options: nosniff` and a CSP that forbids everything, so a body that a browser would otherwise sniff
or render as HTML (an upstream error page, a reflected string) can never run script on the gateway's origin. Headers an answer already
carries are kept; the middleware only fills in what is absent, for streams too (the headers leave with the first
message of the answer).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

NOSNIFF = (b"x-content-type-options", b"nosniff")
DEFAULT_CSP = (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'")
_DEFAULTS = (NOSNIFF, DEFAULT_CSP)


class SecurityHeadersMiddleware:
    """Pure ASGI (no body buffering): adds the default headers an `http.response.start` lacks."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {name.lower() for name, _ in headers}
                missing = [pair for pair in _DEFAULTS if pair[0] not in present]
                if missing:
                    message = {**message, "headers": headers + missing}
            await send(message)

        await self.app(scope, receive, send_with_headers)
