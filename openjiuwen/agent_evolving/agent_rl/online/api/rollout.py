"""Rollout routes (docs/rollout.md; CONTRACT §2.10 ext): status, operator decisions, activation of any published
version. The gateway proxies them signed like every control call. Per line (docs/lineages.md): the status takes
`?lineage=`, the decisions a body `{"lineage": ...}` (as `POST /v1/rl/training/runs`); absent = `default`, so the
routes answer exactly as before lineages for the default line."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ...common.wire import routes as rl_routes
from ...common.ids import is_rollout_id
from ...common.lineage import DEFAULT_LINEAGE
from ..lineages import LineageRegistry
from ..lora.gateway_client import GatewayError
from ..rollout.controller import RolloutController
from ..rollout.record import Rollout
from . import openapi
from .body import json_value
from ...common.errors import ApiError, JSONBody
from .errors import domain_errors
from .lineages import known_lineage


async def _lineage_body(request: Request) -> object:
    """The lineage a decision names: absent, null and {} mean `default`; `{"lineage": L}` L's line."""
    body = await json_value(request)
    if body is not None and (not isinstance(body, dict) or not set(body) <= {"lineage"}):
        raise ApiError(400, "invalid_rollout_request", 'body must be absent, null, {} or {"lineage": ...}')
    return (body or {}).get("lineage", DEFAULT_LINEAGE)


def build_rollout_router(controller: RolloutController, lineages: LineageRegistry) -> APIRouter:
    router = APIRouter()

    async def known(lineage: object) -> str:
        return await known_lineage(lineages, lineage)

    async def operate(call: Any) -> JSONBody:
        try:
            with domain_errors(not_found="rollout_not_found", conflict="no_rollout", invalid="invalid_lora_name"):
                return JSONBody(_answer(await call()))
        except GatewayError as exc:
            raise ApiError(502, "gateway_unavailable", str(exc)[:1000]) from exc

    @router.get(rl_routes.ROLLOUT.path, openapi_extra=openapi.ROLLOUT_STATUS)
    async def rollout_status(request: Request) -> JSONBody:
        """The mode, the line's current rollout with both arms and the decision it would take, and its latest
        ones (`?lineage=`, default `default`)."""
        lineage = await known(request.query_params.get("lineage", DEFAULT_LINEAGE))
        return await operate(lambda: controller.status(lineage))

    @router.post(rl_routes.ROLLOUT_PROMOTE.path, openapi_extra=openapi.ROLLOUT_ACTION)
    async def rollout_promote(request: Request) -> JSONBody:
        lineage = await known(await _lineage_body(request))
        return await operate(lambda: controller.promote(lineage))

    @router.post(rl_routes.ROLLOUT_ROLLBACK.path, openapi_extra=openapi.ROLLOUT_ACTION)
    async def rollout_rollback(request: Request) -> JSONBody:
        lineage = await known(await _lineage_body(request))
        return await operate(lambda: controller.rollback(lineage))

    @router.post(rl_routes.ROLLOUT_PAUSE.path, openapi_extra=openapi.ROLLOUT_ACTION)
    async def rollout_pause(request: Request) -> JSONBody:
        lineage = await known(await _lineage_body(request))
        return await operate(lambda: controller.pause(True, lineage))

    @router.post(rl_routes.ROLLOUT_RESUME.path, openapi_extra=openapi.ROLLOUT_ACTION)
    async def rollout_resume(request: Request) -> JSONBody:
        lineage = await known(await _lineage_body(request))
        return await operate(lambda: controller.pause(False, lineage))

    @router.get(rl_routes.ROLLOUT_EVENTS.path)
    async def rollout_events(rollout_id: str) -> JSONBody:
        """The rollout's timeline, oldest first."""
        if not is_rollout_id(rollout_id):
            raise ApiError(404, "rollout_not_found", "rollout not found")
        return await operate(lambda: _items(controller, rollout_id))

    @router.post(rl_routes.LORA_ACTIVATE.path, openapi_extra=openapi.LORA_ACTIVATE)
    async def lora_activate(request: Request) -> JSONBody:
        """Activate a published version of a line (`{"lora_name": "<line>:vN"}`) for every new Task of the line."""
        body = await json_value(request)
        if not isinstance(body, dict) or set(body) != {"lora_name"}:
            raise ApiError(400, "invalid_rollout_request", 'body must be exactly {"lora_name": "<model>:vN"}')
        try:
            with domain_errors(not_found="lora_version_not_found", conflict="rollout_in_progress",
                               invalid="invalid_lora_name"):
                return JSONBody((await controller.activate_version(body["lora_name"])).public())
        except GatewayError as exc:
            raise ApiError(502, "gateway_unavailable", str(exc)[:1000]) from exc

    return router


def _answer(result: Rollout | dict[str, Any]) -> dict[str, Any]:
    """A rollout record answers in its stored form; the status and timeline answers are built as dicts."""
    return result.public() if isinstance(result, Rollout) else result


async def _items(controller: RolloutController, rollout_id: str) -> dict[str, Any]:
    return {"items": await controller.store.events(rollout_id)}
