"""Trajectory routes (CONTRACT §2.7): counters, paged listing, sample detail, exclusion by instance."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from ..store.keys import ALL_SAMPLE_STATUSES
from ..store.trajectories import TrajectoryStore
from . import openapi
from ...common.errors import ApiError
from ...common.ids import MAX_INSTANCE_NAME, is_instance_name
from .body import json_object
from .errors import domain_errors
from .paging import cursor_param, limit_param, status_param


def build_trajectories_router(
    store: TrajectoryStore, *, reward_stats: Callable[[], Awaitable[dict[str, Any]]] | None = None
) -> APIRouter:
    """`reward_stats`, given only under a reward policy, adds the `rewards` section to the counters."""
    router = APIRouter()

    # Declared before `/{trajectory_id}`, which would otherwise capture "stats" as an id (§2.1).
    @router.get("/v1/rl/trajectories/stats")
    async def trajectory_stats() -> dict[str, Any]:
        """Counters read in O(1) from the transactional stats hash."""
        stats = await store.stats()
        if reward_stats is not None:
            stats["rewards"] = await reward_stats()
        return stats

    @router.post("/v1/rl/trajectories/exclude", openapi_extra=openapi.TRAJECTORY_EXCLUDE)
    async def exclude_instance(request: Request) -> dict[str, Any]:
        """An operator excludes what one vLLM instance served from training: its samples not yet claimed become
        `excluded` now, and those published later too. Idempotent."""
        body = await json_object(request)
        assert body is not None
        instance = body.get("instance")
        if set(body) != {"instance"} or not is_instance_name(instance):
            raise ApiError(400, "invalid_request",
                           f"body must be exactly {{\"instance\": <instance name, 1..{MAX_INSTANCE_NAME} "
                           "printable characters>}")
        return await store.exclude_instance(instance)

    @router.get("/v1/rl/trajectories", openapi_extra=openapi.TRAJECTORY_LIST)
    async def list_trajectories(request: Request) -> dict[str, Any]:
        """One page in (bucket, score, sample id) order; `next_cursor` is null on the last page."""
        status, limit, cursor = _listing_params(request)
        with domain_errors(not_found="trajectory_not_found", conflict="trajectory_conflict"):
            return await store.list_page(status, limit, cursor)

    @router.get("/v1/rl/trajectories/{trajectory_id}")
    async def trajectory_detail(trajectory_id: str) -> dict[str, Any]:
        """The full sample view with re-assembled token arrays; unknown or malformed ids are 404."""
        detail = await store.detail(trajectory_id)
        if detail is None:
            raise ApiError(404, "trajectory_not_found", "trajectory not found")
        return detail

    return router


def _listing_params(request: Request) -> tuple[str | None, int, str | None]:
    params = request.query_params
    return status_param(params, ALL_SAMPLE_STATUSES), limit_param(params), cursor_param(params)
