"""`GET /health`: Redis reachable, counters readable, background parts healthy (CONTRACT §2.3)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from redis.asyncio import Redis
from redis.exceptions import RedisError

from ...common.wire import routes as rl_routes
from ...common import packed_hook
from ..store import keys
from ...common.errors import JSONBody, envelope

HEALTH_REDIS_TIMEOUT_S = 2.0
HOOK_ENCODINGS = ["json", packed_hook.ENCODING]


def build_health_router(
    redis: Redis, *, model_id: str, extra_checks: list[Callable[[], Awaitable[None] | None]] | None = None,
    on_redis_error: Callable[[], None] | None = None, workers: Callable[[], dict[str, Any]] | None = None,
) -> APIRouter:
    """`workers`: the answering worker's view of its group (`workers: N` > 1), added to the body as `workers`."""
    router = APIRouter()
    checks = list(extra_checks or [])

    @router.get(rl_routes.HEALTH.path)
    async def health() -> JSONBody:
        try:
            async with asyncio.timeout(HEALTH_REDIS_TIMEOUT_S):
                await redis.ping()
                await redis.hlen(keys.traj_stats(model_id))
        except (RedisError, OSError, TimeoutError) as exc:
            if on_redis_error is not None:
                on_redis_error()
            return envelope(503, "service_not_ready", f"redis unavailable: {type(exc).__name__}")
        for check in checks:
            try:
                result = check()
                if result is not None:
                    await result
            except Exception as exc:  # a failing background part makes the service not ready, with its cause
                return envelope(503, "service_not_ready", str(exc) or type(exc).__name__)
        # `hook_encodings`: this project's gateway sends the packed `:after` body only to a service that lists it.
        body = {"status": "ready", "model_id": model_id, "hook_encodings": HOOK_ENCODINGS}
        if workers is not None:
            body["workers"] = workers()
        return JSONBody(body)

    return router
