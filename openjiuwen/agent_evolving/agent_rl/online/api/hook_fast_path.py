"""A lean ASGI path for the capture hooks, in front of the FastAPI app (CONTRACT §2.1, §2.8).

The hooks carry every captured completion; through Starlette's and FastAPI's dispatch and the four middlewares a
small hook spent about a quarter of its CPU before reaching our code. `HookFastPath` answers `POST` on the three
hook paths itself and gives every other request (other routes and methods, lifespan) to the app unchanged.

It answers exactly what the app answers, because it runs the same pieces in the same order: the checks of
GuardMiddleware (loopback 403, bearer 401, Content-Length 400 / 413, a chunked body counted while read) and of
JsonBodyMiddleware (415) through their shared classes, then the hook itself (`CaptureHooks`, the code the FastAPI
routes run), `ApiError` and `PayloadTooLarge` answered with the envelope the app's handlers send, any other exception
through `UnhandledErrors` (logged, counted, the 500 envelope), and the request counted in `rl_http_requests_total`
under the label HttpMetricsMiddleware gives it (`unmatched` for an answer of the guards, else the route's path).
tests/integration/test_hook_fast_path.py compares both paths answer for answer, bytes and headers included.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from ...common.content_type import BodyTypeGuard, send_unsupported
from ...common.errors import ApiError, PayloadTooLarge, UnhandledErrors, envelope_bytes
from ...common.request_guards import Admission, BodyCounter, RequestGuard
from ...common.http_metrics import UNMATCHED_ROUTE, StatusTap
from ...common.wire import routes as rl_routes
from .capture_hooks import BodyReader, CaptureHooks

Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Headers, bytes]  # status, headers, body


def json_answer(status: int, body: bytes) -> Answer:
    """The headers Starlette's `Response.init_headers` gives a JSONBody: length, then type."""
    return status, [(b"content-length", str(len(body)).encode("latin-1")), (b"content-type", b"application/json")], body


def _first_content_type(scope: Scope) -> bytes:
    """The first Content-Type value, as Starlette's `request.headers.get` finds it (ASGI names are lower-case)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value
    return b""


class HookFastPath:
    """Serves `POST /internal/v1/completions:before|after|discard`; see the module docstring."""

    def __init__(
        self,
        hooks: CaptureHooks,
        *,
        guard: RequestGuard,
        body_types: BodyTypeGuard,
        unhandled: UnhandledErrors,
        observe: Callable[[str, int], None],
    ) -> None:
        self._hooks = hooks
        # The app's own pieces, run here in the app's order: guards, body type, catch-all, request counting.
        self._guard, self._body_types, self._unhandled, self._observe = guard, body_types, unhandled, observe
        self._routes: dict[str, Callable[[Scope, BodyReader], Awaitable[Answer]]] = {
            rl_routes.HOOK_BEFORE.path: self._before, rl_routes.HOOK_AFTER.path: self._after,
            rl_routes.HOOK_DISCARD.path: self._discard,
        }

    def serves(self, scope: Scope) -> bool:
        """A POST on a hook path the app's router would match (no root path to strip)."""
        return (scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") in self._routes
                and not scope.get("root_path"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        counted_send = StatusTap(send)  # counted as HttpMetricsMiddleware counts
        route = UNMATCHED_ROUTE
        try:
            admission = await self._guard.admit(scope, receive, counted_send)
            if admission is Admission.REFUSED:
                return
            if self._body_types.refuses(scope):
                await send_unsupported(counted_send)
                return
            route = path  # past the guards the app's router matches the route: its template is the path itself
            await self._serve(self._routes[path], scope, receive, counted_send,
                              counter=None if admission is Admission.SIZED else BodyCounter(
                                  self._guard.max_body_bytes, counted_send, receive))
        finally:
            self._observe(route, counted_send.status)

    async def _serve(
        self,
        handler: Callable[[Scope, BodyReader], Awaitable[Answer]],
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        counter: BodyCounter | None,
    ) -> None:
        started = False

        async def route_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            # Past the limit of a chunked body the 413 closes the connection and drains the rest (GuardMiddleware).
            await ((counter.over if counter is not None else None) or send)(message)

        async def read_body() -> bytes:
            # Starlette's `Request.body()`, with GuardMiddleware's count of a chunked body.
            chunks: list[bytes] = []
            while True:
                message = await receive()
                if message["type"] == "http.request":
                    if counter is not None:
                        counter.add(message)  # PayloadTooLarge past the limit
                    body = message.get("body", b"")
                    if body:
                        chunks.append(body)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
                elif message["type"] == "http.disconnect":
                    raise ClientDisconnect()

        try:
            try:
                status, headers, body = await handler(scope, read_body)
            except ApiError as exc:  # the app's exception handlers (common/errors.py) answer these two
                status, headers, body = json_answer(exc.status, envelope_bytes(exc.code, exc.message))
            except PayloadTooLarge as exc:
                status, headers, body = json_answer(413, envelope_bytes("payload_too_large", str(exc)))
            await route_send({"type": "http.response.start", "status": status, "headers": headers})
            await route_send({"type": "http.response.body", "body": body})
        except Exception as exc:
            if not await self._unhandled.answer(scope, route_send, exc, started=started):
                raise

    async def _before(self, scope: Scope, read_body: BodyReader) -> Answer:
        return json_answer(200, orjson.dumps(await self._hooks.before(read_body)))  # JSONBody renders with orjson

    async def _after(self, scope: Scope, read_body: BodyReader) -> Answer:
        await self._hooks.after(read_body, _first_content_type(scope))
        return 204, [], b""  # Starlette's `Response(status_code=204)`: no header, no body

    async def _discard(self, scope: Scope, read_body: BodyReader) -> Answer:
        await self._hooks.discard(read_body)
        return 204, [], b""


class ServiceApp(FastAPI):
    """The RL Service's FastAPI app with `hook_fast_path` in front of its whole stack (set by `create_app`).

    FastAPI's native OpenTelemetry instrumentation is off unless a provider is configured in the process (the
    service configures none); when it is on, every request goes through FastAPI so that hooks get their spans too."""

    hook_fast_path: HookFastPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.hook_fast_path
        if fast is not None and fast.serves(scope) and not self.root_path and not self._telemetry_enabled():
            scope["app"] = self
            await fast(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def _telemetry_enabled(self) -> bool:
        telemetry: Any = getattr(self, "_native_telemetry", None)
        return telemetry is not None and telemetry.enabled()
