"""Lineage routes (CONTRACT §2.10 ext, docs/lineages.md): the registered lineages, page by page; an operator pauses
or resumes a lineage's automatic training, reads the scheduler's view of it, and archives, restores or deletes it
("Lifecycle")."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import QueryParams

from ...common.wire import routes as rl_routes
from ...common.errors import ApiError, JSONBody
from ...common.lineage import is_lineage
from ..errors import InvalidInput
from ..lineage_lifecycle import LineageGatewayError, LineageLifecycle
from ..lineage_state import LineageStatus
from ..lineages import LineageRegistry
from ..training.scheduler import TrainingScheduler
from .errors import domain_errors
from . import openapi
from .body import json_value
from .paging import cursor_param, limit_param

_NOT_FOUND = "lineage_not_found"


async def known_lineage(registry: LineageRegistry, value: object) -> str:
    """The lineage a request names, when it exists: 400 `invalid_lineage` for a malformed name (it never reaches a
    key builder), 404 `lineage_not_found` for one never registered (it has no line) or being deleted (what is left of
    it is never served). Fails closed."""
    if not is_lineage(value):
        raise ApiError(400, "invalid_lineage", "lineage must be 1-63 of [a-z0-9-], and not v<digits>")
    assert isinstance(value, str)
    status = await registry.status(value)
    if status is None:
        raise ApiError(404, _NOT_FOUND, f"lineage {value!r} does not exist")
    if status is LineageStatus.DELETING:
        raise ApiError(404, _NOT_FOUND, f"lineage {value!r} is being deleted")
    return value


async def lineage_param(params: QueryParams, registry: LineageRegistry) -> str | None:
    """The `?lineage=` filter of a listing: None when absent, else a known lineage (400 / 404 as `known_lineage`).
    An empty value is a malformed name, not an absent one: a filter is never silently dropped."""
    if "lineage" not in params:
        return None
    return await known_lineage(registry, params.get("lineage"))


async def _empty_body(request: Request) -> None:
    body = await json_value(request)
    if body is not None and body != {}:
        raise ApiError(400, "invalid_lineage_request", "body must be absent, null or {}")


async def _delete_body(request: Request) -> bool:
    body = await json_value(request)
    if body is None or body == {}:
        return False
    if not isinstance(body, dict) or set(body) != {"remove_files"} or not isinstance(body["remove_files"], bool):
        raise ApiError(400, "invalid_lineage_request", "body must be absent, null, {} or {\"remove_files\": true|false}")
    return body["remove_files"]


async def _answer(call: Awaitable[dict[str, Any]], status_code: int = 200) -> JSONBody:
    try:
        with domain_errors(not_found=_NOT_FOUND, conflict="lineage_busy"):
            return JSONBody(await call, status_code=status_code)
    except LineageGatewayError as exc:
        raise ApiError(502, "gateway_unavailable", exc.message) from exc


def build_lineages_router(scheduler: TrainingScheduler, registry: LineageRegistry,
                          lifecycle: LineageLifecycle) -> APIRouter:
    router = APIRouter()

    async def view(lineage: str) -> dict[str, Any]:
        return {**await scheduler.view(lineage), **await lifecycle.describe(lineage)}

    async def then_view(lineage: str, action: Awaitable[dict[str, Any]], status_code: int = 200) -> JSONBody:
        """Carry out an operator action, then answer the lineage's whole view (the same shape as its GET)."""
        await _answer(action)
        return await _answer(view(lineage), status_code)

    @router.get(rl_routes.LINEAGE_LIST.path, openapi_extra=openapi.LINEAGE_LIST)
    async def list_lineages(request: Request) -> JSONBody:
        """Registered lineages newest first (by first use), each with its line, pending samples and active run;
        `default` always exists and is not listed. `next_cursor` is null on the last page."""
        params = request.query_params
        try:
            return JSONBody(await registry.page(limit=limit_param(params), cursor=cursor_param(params)))
        except InvalidInput as exc:  # a cursor that is not one of ours
            raise ApiError(400, exc.code or "invalid_request", exc.message) from exc

    @router.get(rl_routes.LINEAGE.path)
    async def get_lineage(lineage: str) -> JSONBody:
        """Paused or not, the training policy, the scheduler's view (pending, oldest wait, next eligible time) and
        the lifecycle state (`live`, `archived`, `deleting`)."""
        return await _answer(view(lineage))

    @router.post(rl_routes.LINEAGE_PAUSE.path, openapi_extra=openapi.LINEAGE_ACTION)
    async def pause(lineage: str, request: Request) -> JSONBody:
        """Stop automatic Training Runs of the lineage (manual runs still start); kept until resumed."""
        await _empty_body(request)
        return await then_view(lineage, scheduler.pause(lineage))

    @router.post(rl_routes.LINEAGE_RESUME.path, openapi_extra=openapi.LINEAGE_ACTION)
    async def resume(lineage: str, request: Request) -> JSONBody:
        """Let the scheduler start the lineage's runs again."""
        await _empty_body(request)
        return await then_view(lineage, scheduler.resume(lineage))

    @router.post(rl_routes.LINEAGE_ARCHIVE.path, openapi_extra=openapi.LINEAGE_ACTION)
    async def archive(lineage: str, request: Request) -> JSONBody:
        """No new Task, no Training Run, its versions unloaded at the gateway; everything recorded stays, and a
        restore serves its version again. Refused while it has an active Task, a run or a rollout not ended."""
        await _empty_body(request)
        return await then_view(lineage, lifecycle.archive(lineage))

    @router.post(rl_routes.LINEAGE_RESTORE.path, openapi_extra=openapi.LINEAGE_ACTION)
    async def restore(lineage: str, request: Request) -> JSONBody:
        """An archived lineage is live again, the version it served when archived active again on its line."""
        await _empty_body(request)
        return await then_view(lineage, lifecycle.restore(lineage))

    @router.post(rl_routes.LINEAGE_DELETE.path, openapi_extra=openapi.LINEAGE_DELETE)
    async def delete(lineage: str, request: Request) -> JSONBody:
        """Mark the lineage for deletion (202): the leader unloads its versions, removes its records in batches
        and, with `remove_files`, its repository files; it then leaves the registry (404 from then on)."""
        remove_files = await _delete_body(request)
        return await then_view(lineage, lifecycle.delete(lineage, remove_files=remove_files), status_code=202)

    return router
