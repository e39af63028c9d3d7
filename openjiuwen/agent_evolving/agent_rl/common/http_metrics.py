"""Prometheus pieces both processes use: the exposition content type, the latency buckets of fast answers, and the
middleware that counts every answer by route template and status."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # `text/plain; version=0.0.4` (CONTRACT §2.3)

FAST_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
UNMATCHED_ROUTE = "unmatched"  # unknown paths share one label, so scanners cannot grow the series count


def route_label(scope: Scope) -> str:
    """The matched route template (`/v1/rl/tasks/{rl_task_id}`), never the raw path."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED_ROUTE


class HttpMetricsMiddleware:
    """Counts every answer by route template and status, auth and size refusals included (outermost middleware)."""

    def __init__(self, app: ASGIApp, *, observe: Callable[[str, int], None]) -> None:
        self.app = app
        self._observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            self._observe(route_label(scope), status)
