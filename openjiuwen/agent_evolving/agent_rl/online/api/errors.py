"""The one error envelope `{"error": {"code", "message"}}` and the mapping of domain errors onto it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
import orjson
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import Conflict, InvalidInput, JudgeFailed, NotFound
from ..ids import InvalidIdentifier

log = logging.getLogger("openjiuwen.agent_rl.online.api")


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


@contextmanager
def domain_errors(*, not_found: str, conflict: str, invalid: str | None = None) -> Iterator[None]:
    """Translate domain errors raised inside the block into the route's codes."""
    try:
        yield
    except InvalidInput as exc:
        raise ApiError(400, invalid or exc.code or "invalid_request", exc.message) from exc
    except InvalidIdentifier as exc:
        raise ApiError(404, not_found, str(exc)) from exc
    except NotFound as exc:
        raise ApiError(404, not_found, exc.message) from exc
    except Conflict as exc:
        raise ApiError(409, exc.code or conflict, exc.message) from exc
    except JudgeFailed as exc:
        # The contract answers a Judge failure with the plain 500 envelope; the cause goes to the log only.
        log.warning("judge failure: %s", exc.message)
        raise ApiError(500, "internal_error", "internal service error") from exc


def install_error_envelope(app: FastAPI) -> None:
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

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONBody:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return envelope(500, "internal_error", "internal service error")
