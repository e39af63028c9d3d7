"""Leader-only requests on a follower: relayed to the leader's private port.

The Training Runner and the rollout controller keep in-process state (the executing run, the one change of rollout
state at a time), so the routes that change them run on the leader only (flagged `leader_only` in
common/wire/routes.py). The shared port hands a connection to any
worker; a follower relays such a request over loopback to the leader's private port (the lease names it) and
returns the leader's answer unchanged. With no leader (a failover: the dead leader's slot restarted, or its lease
TTL passed) the follower waits for one up to `FAILOVER_WAIT_S`, then answers 503 `service_not_ready`. A relay that
loses its answer (the leader died mid-request) is not repeated — the outcome is unknown, as after any 5xx — and a
relayed request is never relayed twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from ...common.errors import envelope_bytes
from ...common.wire.routes import leader_only

from .lease import Holder

log = logging.getLogger("openjiuwen.agent_rl.online.workers")

FORWARDED_HEADER = b"x-rl-forwarded"
# Training Runs and rollouts can take long to settle (a stop waits for the run); the caller bounds its own wait.
FORWARD_TIMEOUT_S = 600.0
FAILOVER_WAIT_S = 10.0  # longer than a lease TTL (5 s) plus a worker's restart
FAILOVER_POLL_S = 0.1
_RELAYED_HEADERS = (b"authorization", b"content-type")


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
        if FORWARDED_HEADER in headers:  # relayed to a worker that lost the lease meanwhile: never twice
            await _answer(send, 503, "service_not_ready", "this RL Service worker is not the leader; retry shortly")
            return
        body = await _read_body(receive)
        relayed = {k.decode(): v.decode("latin-1") for k, v in headers.items() if k in _RELAYED_HEADERS}
        relayed[FORWARDED_HEADER.decode()] = "1"
        target = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
        resp = await self._relay(scope["method"], target, body, relayed)
        if resp is None:
            await _answer(send, 503, "service_not_ready",
                          "no RL Service worker holds the leader lease right now; retry shortly")
            return
        out = [(b"content-type", resp.headers.get("content-type", "application/json").encode("latin-1")),
               (b"content-length", str(len(resp.content)).encode())]
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
        await send({"type": "http.response.body", "body": resp.content})

    async def _relay(self, method: str, target: str, body: bytes, headers: dict[str, str]) -> httpx.Response | None:
        """The leader's answer; None when no leader took the request within the failover wait, or when it died
        with the request (its outcome is then unknown: not repeated). A refused connection is a leader that is
        gone before it read anything: wait for the next one."""
        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False)  # loopback: never through an HTTP proxy
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FAILOVER_WAIT_S
        while True:
            holder = await self._leader()  # this worker, if it won the lease meanwhile: relaying to itself is fine
            if holder is not None:
                try:
                    return await self._client.request(method, f"http://127.0.0.1:{holder.port}{target}",
                                                      content=body, headers=headers, timeout=FORWARD_TIMEOUT_S)
                except httpx.ConnectError:
                    pass
                except httpx.HTTPError as exc:
                    log.warning("relaying %s %s to the leader (worker %d) failed: %s", method, target,
                                holder.worker, type(exc).__name__)
                    return None
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(FAILOVER_POLL_S)

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
