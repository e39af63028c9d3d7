"""Trajectory routes (CONTRACT §2.7): counters, paged listing, sample detail."""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request

from ..store.keys import SAMPLE_STATUSES
from ..store.trajectories import TrajectoryStore
from . import openapi
from .errors import ApiError, domain_errors

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
_DIGITS = re.compile(r"[0-9]{1,4}")


def build_trajectories_router(store: TrajectoryStore) -> APIRouter:
    router = APIRouter()

    # Declared before `/{trajectory_id}`, which would otherwise capture "stats" as an id (§2.1).
    @router.get("/v1/rl/trajectories/stats")
    async def trajectory_stats() -> dict[str, Any]:
        """Counters read in O(1) from the transactional stats hash."""
        return await store.stats()

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
    status = params.get("status") or None  # an empty value means absent, like a missing parameter
    if status is not None and status not in SAMPLE_STATUSES:
        raise ApiError(400, "invalid_request", "status must be one of pending, training, trained, failed")
    raw_limit = params.get("limit") or None
    limit = DEFAULT_LIMIT
    if raw_limit is not None:
        if not _DIGITS.fullmatch(raw_limit) or not 1 <= int(raw_limit) <= MAX_LIMIT:
            raise ApiError(400, "invalid_request", f"limit must be an integer between 1 and {MAX_LIMIT}")
        limit = int(raw_limit)
    cursor = params.get("cursor") or None
    return status, limit, cursor
