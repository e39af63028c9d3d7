"""The one error envelope `{"error": {"code", "message"}}` every process answers with, and the catch-all that keeps an
unhandled exception from leaking anything but that envelope."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
import orjson
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("openjiuwen.agent_rl.http")  # unhandled errors of an app that names no logger of its own


class JSONBody(Response):
    """A JSON response rendered with orjson (bodies here carry large token arrays)."""

    media_type = "application/json"

    def render(self, content: object) -> bytes:
        return orjson.dumps(content)


class ApiError(Exception):
    """An answer already decided by a router: status, contract code, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class PayloadTooLarge(Exception):
    """Raised while reading a chunked body past `max_body_bytes`."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")


def envelope(status: int, code: str, message: str) -> JSONBody:
    return JSONBody({"error": {"code": code, "message": message}}, status_code=status)


def envelope_bytes(code: str, message: str) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message}})


class UnhandledErrors:
    """What happens to an exception no handler answered: logged with its details, counted (`on_error`), and answered
    with exactly the 500 envelope, unless the response had started (then nothing sound can be sent)."""

    def __init__(
        self, *, message: str, logger: logging.Logger, on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self._body = envelope_bytes("internal_error", message)
        self._log = logger
        self._on_error = on_error

    async def answer(self, scope: Scope, send: Send, exc: Exception, *, started: bool) -> bool:
        """Log and count `exc`; send the 500 envelope and return True, or return False when the response had
        started (the caller re-raises)."""
        self._log.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
        if self._on_error is not None:
            self._on_error(exc)  # e.g. counting Redis errors
        if started:
            return False
        await send({"type": "http.response.start", "status": 500, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(self._body)).encode())]})
        await send({"type": "http.response.body", "body": self._body})
        return True


class CatchAllMiddleware:
    """Any unhandled exception → exactly the 500 envelope, with the details in the log only (`UnhandledErrors`).

    A pure ASGI middleware rather than an `exception_handler(Exception)`: Starlette re-raises after such a handler
    answered, and the server then drops the keep-alive connection under a client that is about to reuse it."""

    def __init__(
        self, app: ASGIApp, *, message: str, logger: logging.Logger,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.app = app
        self._unhandled = UnhandledErrors(message=message, logger=logger, on_error=on_error)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if not await self._unhandled.answer(scope, send, exc, started=started):
                raise  # the answer is already on its way


INTERNAL_ERROR_MESSAGE = "internal service error"  # the 500 envelope's message (CONTRACT §2.1)


def install_error_envelope(
    app: FastAPI, *, logger: logging.Logger | None = None, message: str = INTERNAL_ERROR_MESSAGE,
    on_error: Callable[[Exception], None] | None = None,
) -> None:
    """Every client mistake and every unhandled error of `app` answered with the envelope."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONBody:
        return envelope(exc.status, exc.code, exc.message)

    @app.exception_handler(PayloadTooLarge)
    async def _too_large(_: Request, exc: PayloadTooLarge) -> JSONBody:
        return envelope(413, "payload_too_large", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONBody:
        return envelope(exc.status_code, "request_failed", str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONBody:
        return envelope(400, "invalid_request", "invalid request parameters")

    app.add_middleware(CatchAllMiddleware, message=message, logger=logger or log, on_error=on_error)
