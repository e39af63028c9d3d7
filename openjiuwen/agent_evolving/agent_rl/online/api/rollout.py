"""Rollout routes (docs/rollout.md; CONTRACT §2.10 ext): status, operator decisions, activation of any published
version. The gateway proxies them signed like every control call."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ...common.ids import is_rollout_id
from ..lora.gateway_client import GatewayError
from ..rollout.controller import RolloutController
from . import openapi
from .body import json_value
from ...common.errors import ApiError, JSONBody
from .errors import domain_errors


async def _empty_body(request: Request) -> None:
    body = await json_value(request)
    if body is not None and body != {}:
        raise ApiError(400, "invalid_rollout_request", "body must be absent, null or {}")


def build_rollout_router(controller: RolloutController) -> APIRouter:
    router = APIRouter()

    async def operate(call: Any) -> JSONBody:
        try:
            with domain_errors(not_found="rollout_not_found", conflict="no_rollout", invalid="invalid_lora_name"):
                return JSONBody(await call())
        except GatewayError as exc:
            raise ApiError(502, "gateway_unavailable", str(exc)[:1000]) from exc

    @router.get("/v1/rl/rollout")
    async def rollout_status() -> JSONBody:
        """The mode, the current rollout with both arms and the decision it would take, and the latest ones."""
        return await operate(controller.status)

    @router.post("/v1/rl/rollout/promote", openapi_extra=openapi.ROLLOUT_ACTION)
    async def rollout_promote(request: Request) -> JSONBody:
        await _empty_body(request)
        return await operate(controller.promote)

    @router.post("/v1/rl/rollout/rollback", openapi_extra=openapi.ROLLOUT_ACTION)
    async def rollout_rollback(request: Request) -> JSONBody:
        await _empty_body(request)
        return await operate(controller.rollback)

    @router.post("/v1/rl/rollout/pause", openapi_extra=openapi.ROLLOUT_ACTION)
    async def rollout_pause(request: Request) -> JSONBody:
        await _empty_body(request)
        return await operate(lambda: controller.pause(True))

    @router.post("/v1/rl/rollout/resume", openapi_extra=openapi.ROLLOUT_ACTION)
    async def rollout_resume(request: Request) -> JSONBody:
        await _empty_body(request)
        return await operate(lambda: controller.pause(False))

    @router.get("/v1/rl/rollout/{rollout_id}/events")
    async def rollout_events(rollout_id: str) -> JSONBody:
        """The rollout's timeline, oldest first."""
        if not is_rollout_id(rollout_id):
            raise ApiError(404, "rollout_not_found", "rollout not found")
        return await operate(lambda: _items(controller, rollout_id))

    @router.post("/v1/rl/loras/activate", openapi_extra=openapi.LORA_ACTIVATE)
    async def lora_activate(request: Request) -> JSONBody:
        """Activate a published version of the model (`{"lora_name": "<model>:vN"}`) for every new Task."""
        body = await json_value(request)
        if not isinstance(body, dict) or set(body) != {"lora_name"}:
            raise ApiError(400, "invalid_rollout_request", 'body must be exactly {"lora_name": "<model>:vN"}')
        try:
            with domain_errors(not_found="lora_version_not_found", conflict="rollout_in_progress",
                               invalid="invalid_lora_name"):
                return JSONBody(await controller.activate_version(body["lora_name"]))
        except GatewayError as exc:
            raise ApiError(502, "gateway_unavailable", str(exc)[:1000]) from exc

    return router


async def _items(controller: RolloutController, rollout_id: str) -> dict[str, Any]:
    return {"items": await controller.store.events(rollout_id)}
