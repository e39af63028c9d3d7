"""Loopback-only routes the gateway calls: capture hooks, internal finish and abort (CONTRACT §2.8, §2.9)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response

from ...common.wire import routes as rl_routes
from ...common import json_nesting, packed_hook
from ...common.content_type import media_type
from ...common.errors import ApiError, JSONBody
from ..tasks.lifecycle import TaskLifecycle
from ..capture.pipeline import CapturePipeline
from ..metrics import ServiceMetrics
from ...common.wire.task_states import FinishReason
from ..capture.ledger import StaleTask
from ..tasks.registry import TaskRegistry
from . import openapi
from .body import json_object, parse_json_object
from .errors import domain_errors
from .tasks import reason_from_body

T = TypeVar("T")

# The one non-JSON body of the service: the packed `:after` (CONTRACT §2.8); JsonBodyMiddleware and the fast path
# (api/hook_fast_path.py) both let it through on that route only.
BINARY_ROUTES = {rl_routes.HOOK_AFTER.path: packed_hook.MEDIA_TYPE}
_PACKED_MEDIA_TYPE = packed_hook.MEDIA_TYPE.encode()
# A hook meets StaleTask only when its Task id was started again as another Task after its record expired; each
# retry runs with the Task as it is now, so a second one is already beyond anything seen.
_STALE_RETRIES = 4

BodyReader = Callable[[], Awaitable[bytes]]


def _hook_body(raw: bytes) -> dict[str, Any]:
    # Lenient: a NaN logprob from an upstream must reach response validation (400 and an aborted Task), not stop
    # at the parser; values JSON cannot carry are refused when the capture is fingerprinted. The request and the
    # response sit one level down in the body, each held to the bound of any body.
    body = parse_json_object(raw, lenient=True, max_depth=json_nesting.MAX_DEPTH + json_nesting.HOOK_WRAPPING)
    assert body is not None
    return body


def _packed_body(raw: bytes) -> tuple[dict[str, Any], packed_hook.PackedArrays]:
    try:
        return packed_hook.unpack_after(raw)
    except packed_hook.PackedBodyError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from exc


async def _again_on_stale(call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, run again when it met a Task id that names another Task now (StaleTask: nothing was written)."""
    for _ in range(_STALE_RETRIES):
        try:
            return await call()
        except StaleTask:
            continue
    return await call()


class CaptureHooks:
    """The three capture hooks from a body reader to the answer's content, metrics included: what the FastAPI
    routes below and the raw ASGI path in front of the app (api/hook_fast_path.py) both run, so that they answer
    alike. Errors are raised as ApiError (the envelope's status, code and message)."""

    def __init__(self, pipeline: CapturePipeline, metrics: ServiceMetrics) -> None:
        self._pipeline = pipeline
        self._metrics = metrics

    async def before(self, read_body: BodyReader) -> dict[str, Any]:
        """The 200 body `{"request": <injected>}`."""
        with self._metrics.hook("before"):
            body = _hook_body(await read_body())
            with domain_errors(not_found="completion_conflict", conflict="completion_conflict"):
                injected = await _again_on_stale(lambda: self._pipeline.before(body))
        return {"request": injected}

    async def after(self, read_body: BodyReader, content_type: bytes) -> None:
        """Commit (204). `content_type`: the request's first Content-Type value, raw."""
        with self._metrics.hook("after"):
            with domain_errors(not_found="completion_conflict", conflict="completion_conflict"):
                packed = media_type(content_type) == _PACKED_MEDIA_TYPE
                raw = await read_body()
                # No local keeps the parsed body: the pipeline drops it before its Redis commit (GC cost); a retry
                # parses the raw body again.
                if packed:
                    committed = await _again_on_stale(lambda: self._pipeline.after_packed(*_packed_body(raw)))
                else:
                    committed = await _again_on_stale(lambda: self._pipeline.after(_hook_body(raw)))
        if committed:  # an idempotent repeat is not a second capture
            self._metrics.capture("committed")

    async def discard(self, read_body: BodyReader) -> None:
        """Drop an open capture (204)."""
        with self._metrics.hook("discard"):
            body = _hook_body(await read_body())
            with domain_errors(not_found="completion_conflict", conflict="completion_conflict"):
                dropped = await self._pipeline.discard(body)
        if dropped:
            self._metrics.capture("discarded")


def _content_type(request: Request) -> bytes:
    return request.headers.get("content-type", "").encode("latin-1")


def build_hooks_router(hooks: CaptureHooks, lifecycle: TaskLifecycle, registry: TaskRegistry) -> APIRouter:
    """The hook routes (for every request the fast path leaves to FastAPI, and for the OpenAPI document) and the
    internal finish and abort."""
    router = APIRouter()

    @router.post(rl_routes.HOOK_BEFORE.path, openapi_extra=openapi.HOOK_BEFORE)
    async def before(request: Request) -> JSONBody:
        return JSONBody(await hooks.before(request.body))

    @router.post(rl_routes.HOOK_AFTER.path, status_code=204, openapi_extra=openapi.HOOK_AFTER)
    async def after(request: Request) -> Response:
        await hooks.after(request.body, _content_type(request))
        return Response(status_code=204)

    @router.post(rl_routes.HOOK_DISCARD.path, status_code=204, openapi_extra=openapi.HOOK_DISCARD)
    async def discard(request: Request) -> Response:
        await hooks.discard(request.body)
        return Response(status_code=204)

    @router.post(rl_routes.TASK_FINISH.path, openapi_extra=openapi.TASK_FINISH)
    async def finish(rl_task_id: str, request: Request) -> dict[str, Any]:
        body = await json_object(request)
        assert body is not None
        reason = reason_from_body(body, {FinishReason.SERVICE_STOPPED.value}, "invalid_finish_reason")
        with domain_errors(not_found="task_conflict", conflict="task_conflict"):
            task = await lifecycle.finish(rl_task_id, reason)
        return task.public()

    @router.post(rl_routes.TASK_ABORT.path, openapi_extra=openapi.TASK_ABORT)
    async def abort(rl_task_id: str, request: Request) -> dict[str, Any]:
        body = await json_object(request)
        assert body is not None
        allowed = {FinishReason.CAPTURE_FAILED.value, FinishReason.TIMEOUT.value}
        reason = reason_from_body(body, allowed, "invalid_abort_reason")
        with domain_errors(not_found="task_conflict", conflict="task_conflict"):
            task = await registry.abort(rl_task_id, reason)
        return task.public()

    return router
