"""`GET /metrics` (CONTRACT §2.3): Prometheus text format, state gauges refreshed at scrape time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Response
from redis.asyncio import Redis

from ...common.wire import routes as rl_routes
from ...common.http_metrics import CONTENT_TYPE
from ..metrics import ServiceMetrics


def build_metrics_router(
    metrics: ServiceMetrics, redis: Redis, stats: Callable[[], Awaitable[dict[str, Any]]]
) -> APIRouter:
    router = APIRouter()

    @router.get(rl_routes.METRICS.path, include_in_schema=False)  # Prometheus text, not part of the JSON API
    async def scrape() -> Response:
        await metrics.refresh(redis, stats)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return router
