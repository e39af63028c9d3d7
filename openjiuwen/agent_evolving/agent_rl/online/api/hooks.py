"""Loopback-only routes the gateway calls: capture hooks, internal finish and abort (CONTRACT §2.8, §2.9)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from ...common import packed_hook
from ...common.content_type import media_type
from ...common.errors import ApiError, JSONBody
from ..capture.lifecycle import TaskLifecycle
from ..capture.pipeline import CapturePipeline
from ..metrics import ServiceMetrics
from ..tasks.models import FinishReason
from ..tasks.registry import TaskRegistry
from . import openapi
from .body import json_object
from .errors import domain_errors
from .tasks import reason_from_body


AFTER_PATH = "/internal/v1/completions:after"
_PACKED_MEDIA_TYPE = packed_hook.MEDIA_TYPE.encode()


async def _hook_body(request: Request) -> dict[str, Any]:
    # Lenient: a NaN logprob from an upstream must reach response validation (400 and an aborted Task), not stop
    # at the parser; values JSON cannot carry are refused when the capture is fingerprinted.
    body = await json_object(request, lenient=True)
    assert body is not None
    return body


def _is_packed(request: Request) -> bool:
    return media_type(request.headers.get("content-type", "").encode("latin-1")) == _PACKED_MEDIA_TYPE


def _packed_body(raw: bytes) -> tuple[dict[str, Any], packed_hook.PackedArrays]:
    try:
        return packed_hook.unpack_after(raw)
    except packed_hook.PackedBodyError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from exc


def build_hooks_router(
    pipeline: CapturePipeline, lifecycle: TaskLifecycle, registry: TaskRegistry, metrics: ServiceMetrics
) -> APIRouter:
    router = APIRouter()

    @router.post("/internal/v1/completions:before", openapi_extra=openapi.HOOK_BEFORE)
    async def before(request: Request) -> JSONBody:
        with metrics.hook("before"):
            body = await _hook_body(request)
            with domain_errors(not_found="completion_conflict", conflict="completion_conflict"):
                injected = await pipeline.before(body)
        return JSONBody({"request": injected})

    @router.post(AFTER_PATH, status_code=204, openapi_extra=openapi.HOOK_AFTER)
    async def after(request: Request) -> Response:
        with metrics.hook("after"):
            with domain_errors(not_found="completion_conflict", conflict="completion_conflict"):
                # No local keeps the parsed body: the pipeline drops it before its Redis commit (GC cost).
                if _is_packed(request):
                    committed = await pipeline.after_packed(*_packed_body(await request.body()))
                else:
                    committed = await pipeline.after(await _hook_body(request))
        if committed:  # an idempotent repeat is not a second capture
            metrics.capture("committed")
        return Response(status_code=204)

    @router.post("/internal/v1/completions:discard", status_code=204, openapi_extra=openapi.HOOK_DISCARD)
    async def discard(request: Request) -> Response:
        with metrics.hook("discard"):
            body = await _hook_body(request)
            with domain_errors(not_found="completion_conflict", conflict="completion_conflict"):
                dropped = await pipeline.discard(body)
        if dropped:
            metrics.capture("discarded")
        return Response(status_code=204)

    @router.post("/internal/v1/rl/tasks/{rl_task_id}:finish", openapi_extra=openapi.TASK_FINISH)
    async def finish(rl_task_id: str, request: Request) -> dict[str, Any]:
        body = await json_object(request)
        assert body is not None
        reason = reason_from_body(body, {FinishReason.SERVICE_STOPPED.value}, "invalid_finish_reason")
        with domain_errors(not_found="task_conflict", conflict="task_conflict"):
            task = await lifecycle.finish(rl_task_id, reason)
        return task.public()

    @router.post("/internal/v1/rl/tasks/{rl_task_id}:abort", openapi_extra=openapi.TASK_ABORT)
    async def abort(rl_task_id: str, request: Request) -> dict[str, Any]:
        body = await json_object(request)
        assert body is not None
        allowed = {FinishReason.CAPTURE_FAILED.value, FinishReason.TIMEOUT.value}
        reason = reason_from_body(body, allowed, "invalid_abort_reason")
        with domain_errors(not_found="task_conflict", conflict="task_conflict"):
            task = await registry.abort(rl_task_id, reason)
        return task.public()

    return router
