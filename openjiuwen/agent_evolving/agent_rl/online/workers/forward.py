"""Leader-only requests on a follower: relayed to the leader's private port.

The Training Runner and the rollout controller keep in-process state (the executing run, the one change of rollout
state at a time), so the routes that change them run on the leader only. The shared port hands a connection to any
worker; a follower relays such a request over loopback to the leader's private port (the lease names it) and
returns the leader's answer unchanged. With no leader (a failover, at most the lease TTL) the answer is 503
`service_not_ready`: the caller retries as after any 503. A relayed request that finds no leader either is never
relayed twice.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

import httpx

from ...common.errors import envelope_bytes

from .lease import Holder

log = logging.getLogger("openjiuwen.agent_rl.online.workers")

FORWARDED_HEADER = b"x-rl-forwarded"
# Training Runs and rollouts can take long to settle (a stop waits for the run); the caller bounds its own wait.
FORWARD_TIMEOUT_S = 600.0
_RELAYED_HEADERS = (b"authorization", b"content-type")

LEADER_ROUTES = (
    ("POST", re.compile(r"^/v1/rl/training/runs$")),
    ("POST", re.compile(r"^/v1/rl/training/runs/[^/]+/stop$")),
    ("POST", re.compile(r"^/v1/rl/rollout/(promote|rollback|pause|resume)$")),
    ("POST", re.compile(r"^/v1/rl/loras/activate$")),
)


def leader_only(method: str, path: str) -> bool:
    return any(method == m and pattern.match(path) for m, pattern in LEADER_ROUTES)


class LeaderForwarding:
    """ASGI middleware: on a follower, relays the leader-only routes; everything else passes through.

    :param is_leader: whether this process holds the lease now (or runs alone).
    :param leader: the current lease holder, read from Redis.
    """

    def __init__(self, app, *, is_leader: Callable[[], bool], leader: Callable[[], Awaitable[Holder | None]]) -> None:
        self.app = app
        self._is_leader = is_leader
        self._leader = leader
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self._is_leader() or not leader_only(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        holder = None if FORWARDED_HEADER in headers else await self._leader()
        if holder is None:
            await _answer(send, 503, "service_not_ready",
                          "no RL Service worker holds the leader lease right now; retry shortly")
            return
        body = await _read_body(receive)
        url = f"http://127.0.0.1:{holder.port}{scope['path']}"
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        relayed = {k.decode(): v.decode("latin-1") for k, v in headers.items() if k in _RELAYED_HEADERS}
        relayed[FORWARDED_HEADER.decode()] = "1"
        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False)  # loopback: never through an HTTP proxy
        try:
            resp = await self._client.request(scope["method"], url, content=body, headers=relayed,
                                              timeout=FORWARD_TIMEOUT_S)
        except httpx.HTTPError as exc:
            log.warning("relaying %s %s to the leader (worker %d) failed: %s", scope["method"], scope["path"],
                        holder.worker, type(exc).__name__)
            await _answer(send, 503, "service_not_ready", "the leader worker did not answer; retry shortly")
            return
        out = [(b"content-type", resp.headers.get("content-type", "application/json").encode("latin-1")),
               (b"content-length", str(len(resp.content)).encode())]
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
        await send({"type": "http.response.body", "body": resp.content})

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


async def _read_body(receive) -> bytes:
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts)
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _answer(send, status: int, code: str, message: str) -> None:
    body = envelope_bytes(code, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
