"""Lineage routes (CONTRACT §2.10 ext, docs/lineages.md): the registered lineages, page by page; an operator pauses
or resumes a lineage's automatic training and reads the scheduler's view of it."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import QueryParams

from ...common.wire import routes as rl_routes
from ...common.errors import ApiError, JSONBody
from ...common.lineage import is_lineage
from ..errors import InvalidInput
from ..lineages import LineageRegistry
from ..training.scheduler import TrainingScheduler, UnknownLineage
from . import openapi
from .body import json_value
from .paging import cursor_param, limit_param

_NOT_FOUND = "lineage_not_found"


async def known_lineage(registry: LineageRegistry, value: object) -> str:
    """The lineage a request names, when it exists: 400 `invalid_lineage` for a malformed name (it never reaches a
    key builder), 404 `lineage_not_found` for one never registered (it has no line). Fails closed."""
    if not is_lineage(value):
        raise ApiError(400, "invalid_lineage", "lineage must be 1-63 of [a-z0-9-], and not v<digits>")
    assert isinstance(value, str)
    if not await registry.exists(value):
        raise ApiError(404, _NOT_FOUND, f"lineage {value!r} does not exist")
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


async def _answer(call: Awaitable[dict[str, Any]]) -> JSONBody:
    try:
        return JSONBody(await call)
    except UnknownLineage as exc:
        raise ApiError(404, _NOT_FOUND, exc.message) from exc


def build_lineages_router(scheduler: TrainingScheduler, registry: LineageRegistry) -> APIRouter:
    router = APIRouter()

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
        """Paused or not, the training policy, and the scheduler's view: pending, oldest wait, next eligible time."""
        return await _answer(scheduler.view(lineage))

    @router.post(rl_routes.LINEAGE_PAUSE.path, openapi_extra=openapi.LINEAGE_ACTION)
    async def pause(lineage: str, request: Request) -> JSONBody:
        """Stop automatic Training Runs of the lineage (manual runs still start); kept until resumed."""
        await _empty_body(request)
        return await _answer(scheduler.pause(lineage))

    @router.post(rl_routes.LINEAGE_RESUME.path, openapi_extra=openapi.LINEAGE_ACTION)
    async def resume(lineage: str, request: Request) -> JSONBody:
        """Let the scheduler start the lineage's runs again."""
        await _empty_body(request)
        return await _answer(scheduler.resume(lineage))

    return router
