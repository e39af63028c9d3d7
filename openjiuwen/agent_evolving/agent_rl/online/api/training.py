"""Training Run routes (CONTRACT §2.6)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..ids import is_run_id
from ..training.runner import GatewayUnavailable, TrainingRunner
from . import openapi
from .body import json_value
from .errors import ApiError, JSONBody, domain_errors

_NOT_FOUND = "training_run_not_found"


def build_training_router(runner: TrainingRunner) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/rl/training/runs", openapi_extra=openapi.TRAINING_START)
    async def start_run(request: Request) -> JSONBody:
        body = await json_value(request)
        if body is not None and body != {}:  # absent, null and {} all mean "start or reuse"
            raise ApiError(400, "invalid_training_request", "body must be absent, null or {}")
        try:
            with domain_errors(not_found=_NOT_FOUND, conflict="insufficient_samples"):
                run, created = await runner.start()
        except GatewayUnavailable as exc:
            raise ApiError(502, "gateway_unavailable", exc.message) from exc
        return JSONBody(run.public(), status_code=201 if created else 200)

    @router.get("/v1/rl/training/runs/{training_run_id}")
    async def get_run(training_run_id: str) -> dict[str, Any]:
        if not is_run_id(training_run_id):  # a malformed id is simply unknown
            raise ApiError(404, _NOT_FOUND, "training run not found")
        with domain_errors(not_found=_NOT_FOUND, conflict="training_run_conflict"):
            return (await runner.get(training_run_id)).public()

    @router.post("/v1/rl/training/runs/{training_run_id}/stop")
    async def stop_run(training_run_id: str) -> dict[str, Any]:
        if not is_run_id(training_run_id):
            raise ApiError(404, _NOT_FOUND, "training run not found")
        with domain_errors(not_found=_NOT_FOUND, conflict="training_run_conflict"):
            return (await runner.stop(training_run_id)).public()

    return router
