"""Training Run routes (CONTRACT §2.6)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ...common.wire import routes as rl_routes
from ...common.ids import is_run_id
from ...common.lineage import DEFAULT_LINEAGE, is_lineage
from ..training.runner import GatewayUnavailable, TrainingRunner
from . import openapi
from .body import json_value
from ...common.errors import ApiError, JSONBody
from .errors import domain_errors
from .lineages import lineage_param
from ..lineages import LineageRegistry
from .paging import cursor_param, limit_param

_NOT_FOUND = "training_run_not_found"


def build_training_router(runner: TrainingRunner, lineages: LineageRegistry) -> APIRouter:
    router = APIRouter()

    @router.post(rl_routes.RUN_START.path, openapi_extra=openapi.TRAINING_START)
    async def start_run(request: Request) -> JSONBody:
        body = await json_value(request)
        # Absent, null and {} all mean "start or reuse" on the default lineage; {"lineage": L} on L's line (ext).
        if body is not None and (not isinstance(body, dict) or not set(body) <= {"lineage"}):
            raise ApiError(400, "invalid_training_request", "body must be absent, null, {} or {\"lineage\": ...}")
        lineage = (body or {}).get("lineage", DEFAULT_LINEAGE)
        if not is_lineage(lineage):
            raise ApiError(400, "invalid_lineage", "lineage must be 1-63 of a-z, 0-9 and '-', and not v<digits>")
        try:
            with domain_errors(not_found=_NOT_FOUND, conflict="insufficient_samples"):
                run, created = await runner.start(lineage=lineage)
        except GatewayUnavailable as exc:
            raise ApiError(502, "gateway_unavailable", exc.message) from exc
        return JSONBody(run.public(), status_code=201 if created else 200)

    @router.get(rl_routes.RUN_LIST.path, openapi_extra=openapi.RUN_LIST)
    async def list_runs(request: Request) -> JSONBody:
        """Public run records newest first by creation, optionally one lineage's (`?lineage=`, ext:
        docs/lineages.md); `next_cursor` is null on the last page."""
        params = request.query_params
        limit, cursor = limit_param(params), cursor_param(params)
        lineage = await lineage_param(params, lineages)
        with domain_errors(not_found=_NOT_FOUND, conflict="training_run_conflict"):
            return JSONBody(await runner.list_runs(limit, cursor, lineage))

    @router.get(rl_routes.RUN_EVENTS.path)
    async def run_events(training_run_id: str) -> JSONBody:
        """The run timeline, oldest first (bounded to about 1000 entries)."""
        if not is_run_id(training_run_id):
            raise ApiError(404, _NOT_FOUND, "training run not found")
        with domain_errors(not_found=_NOT_FOUND, conflict="training_run_conflict"):
            return JSONBody({"items": await runner.events(training_run_id)})

    @router.get(rl_routes.RUN.path)
    async def get_run(training_run_id: str) -> dict[str, Any]:
        if not is_run_id(training_run_id):  # a malformed id is simply unknown
            raise ApiError(404, _NOT_FOUND, "training run not found")
        with domain_errors(not_found=_NOT_FOUND, conflict="training_run_conflict"):
            return (await runner.get(training_run_id)).public()

    @router.post(rl_routes.RUN_STOP.path)
    async def stop_run(training_run_id: str) -> dict[str, Any]:
        if not is_run_id(training_run_id):
            raise ApiError(404, _NOT_FOUND, "training run not found")
        with domain_errors(not_found=_NOT_FOUND, conflict="training_run_conflict"):
            return (await runner.stop(training_run_id)).public()

    return router
