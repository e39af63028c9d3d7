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


class StatusTap:
    """An ASGI `send` that passes every message on and keeps the status of the answer it started: 500 until one
    starts, which is what a request that died before answering is counted as. Both ways a request is counted (this
    middleware and the RL Service's hook fast path) read the status here, so they count the same."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 500

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
        await self._send(message)


class HttpMetricsMiddleware:
    """Counts every answer by route template and status, auth and size refusals included (outermost middleware)."""

    def __init__(self, app: ASGIApp, *, observe: Callable[[str, int], None]) -> None:
        self.app = app
        self._observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tap = StatusTap(send)
        try:
            await self.app(scope, receive, tap)
        finally:
            self._observe(route_label(scope), tap.status)
