"""Trajectory routes (CONTRACT §2.7): counters, paged listing, sample detail, exclusion by instance."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from ...common.wire import routes as rl_routes
from ..store.keys import ALL_SAMPLE_STATUSES
from ..lineages import LineageRegistry
from ..store.instance_exclusion import InstanceExclusion
from ..store.sample_documents import SampleDocuments
from ..store.sample_line import SampleLine
from ..store.sample_listing import SampleListing
from ..store.sample_stats import SampleStats
from . import openapi
from .lineages import known_lineage
from ...common.errors import ApiError
from ...common.ids import MAX_INSTANCE_NAME, is_instance_name
from .body import json_object
from .errors import domain_errors
from .paging import cursor_param, limit_param, status_param


def build_trajectories_router(
    line: SampleLine, lineages: LineageRegistry, *, stats: SampleStats, listing: SampleListing,
    documents: SampleDocuments, exclusion: InstanceExclusion,
    reward_stats: Callable[[], Awaitable[dict[str, Any]]] | None = None,
) -> APIRouter:
    """`reward_stats`, given only under a reward policy, adds the `rewards` section to the counters. The listing and
    the counters are one line's: the default line's, or with `?lineage=` that lineage's (docs/lineages.md)."""

    async def line_of_request(request: Request) -> SampleLine:
        lineage = request.query_params.get("lineage")
        return line if lineage is None else line.for_lineage(await known_lineage(lineages, lineage))

    router = APIRouter()

    # Declared before `/{trajectory_id}`, which would otherwise capture "stats" as an id (§2.1).
    @router.get(rl_routes.TRAJECTORY_STATS.path, openapi_extra=openapi.TRAJECTORY_STATS)
    async def trajectory_stats(request: Request) -> dict[str, Any]:
        """Counters read in O(1) from the transactional stats hash."""
        counters = await stats.stats(await line_of_request(request))
        if reward_stats is not None:
            counters["rewards"] = await reward_stats()
        return counters

    @router.post(rl_routes.TRAJECTORY_EXCLUDE.path, openapi_extra=openapi.TRAJECTORY_EXCLUDE)
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
        return await exclusion.exclude_instance(instance)

    @router.get(rl_routes.TRAJECTORY_LIST.path, openapi_extra=openapi.TRAJECTORY_LIST)
    async def list_trajectories(request: Request) -> dict[str, Any]:
        """One page in (bucket, score, sample id) order; `next_cursor` is null on the last page."""
        status, limit, cursor = _listing_params(request)
        requested = await line_of_request(request)
        with domain_errors(not_found="trajectory_not_found", conflict="trajectory_conflict"):
            return await listing.list_page(requested, status, limit, cursor)

    @router.get(rl_routes.TRAJECTORY.path)
    async def trajectory_detail(trajectory_id: str) -> dict[str, Any]:
        """The full sample view with re-assembled token arrays; unknown or malformed ids are 404."""
        detail = await documents.detail(trajectory_id)
        if detail is None:
            raise ApiError(404, "trajectory_not_found", "trajectory not found")
        return detail

    return router


def _listing_params(request: Request) -> tuple[str | None, int, str | None]:
    params = request.query_params
    return status_param(params, ALL_SAMPLE_STATUSES), limit_param(params), cursor_param(params)
