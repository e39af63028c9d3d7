"""Leader-only routes on a follower are relayed to the leader's private port (CONTRACT §2.11, workers/forward.py).

The follower is the middleware in front of a stand-in app; the leader is a real uvicorn server on a loopback port
that records what reached it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from openjiuwen.agent_evolving.agent_rl.online.workers import forward
from openjiuwen.agent_evolving.agent_rl.common.wire.routes import leader_only
from openjiuwen.agent_evolving.agent_rl.online.workers.forward import LeaderForwarding
from openjiuwen.agent_evolving.agent_rl.online.workers.lease import Holder
from tests.support.asgi_server import ThreadedServer
from tests.support.redis_server import free_port


class Leader:
    """The leader's private port: answers 201 with what it received."""

    def __init__(self, port: int = 0) -> None:
        self.seen: list[dict] = []

        async def runs(request: Request) -> JSONResponse:
            self.seen.append({"path": request.url.path, "query": request.url.query, "body": await request.body(),
                              "headers": dict(request.headers)})
            return JSONResponse({"training_run_id": "run-000000000001", "relayed": True}, status_code=201)

        app = Starlette(routes=[Route("/v1/rl/training/runs", runs, methods=["POST"])])
        self.server = ThreadedServer(app, name="leader", port=port)


def local_app(calls: list[str]):
    async def app(scope, receive, send) -> None:
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"local"})

    return app


def client(middleware: LeaderForwarding) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware), base_url="http://rl.test", timeout=30)


def test_the_leader_only_routes() -> None:
    assert leader_only("POST", "/v1/rl/training/runs")
    assert leader_only("POST", "/v1/rl/training/runs/run-0123456789ab/stop")
    assert leader_only("POST", "/v1/rl/rollout/promote") and leader_only("POST", "/v1/rl/loras/activate")
    assert not leader_only("GET", "/v1/rl/training/runs")
    assert not leader_only("POST", "/internal/v1/completions:after")
    assert not leader_only("POST", "/v1/rl/training/runs/run-0123456789ab/stop/x")


async def test_a_follower_relays_a_leader_route_and_passes_everything_else() -> None:
    leader = Leader()
    await leader.server.astart()
    calls: list[str] = []
    try:
        async def where() -> Holder:
            return Holder("b", 1, 1, leader.server.port)

        mw = LeaderForwarding(local_app(calls), is_leader=lambda: False, leader=where)
        async with client(mw) as c:
            r = await c.post("/v1/rl/training/runs?x=1", content=b"{}",
                             headers={"authorization": "Bearer tok", "content-type": "application/json",
                                      "x-other": "not relayed"})
            assert (r.status_code, r.json()) == (201, {"training_run_id": "run-000000000001", "relayed": True})
            assert r.headers["content-type"] == "application/json"
            local = await c.get("/v1/rl/training/runs")
            assert local.text == "local"
        await mw.aclose()
        [seen] = leader.seen
        assert (seen["path"], seen["query"], seen["body"]) == ("/v1/rl/training/runs", "x=1", b"{}")
        assert seen["headers"]["authorization"] == "Bearer tok" and seen["headers"]["x-rl-forwarded"] == "1"
        assert "x-other" not in seen["headers"]
        assert calls == ["/v1/rl/training/runs"]  # only the GET reached the follower's own app
    finally:
        await leader.server.astop()


async def test_the_leader_serves_its_routes_itself() -> None:
    calls: list[str] = []

    async def nobody() -> Holder | None:
        raise AssertionError("a leader never looks the lease up")

    async with client(LeaderForwarding(local_app(calls), is_leader=lambda: True, leader=nobody)) as c:
        assert (await c.post("/v1/rl/training/runs")).text == "local"
    assert calls == ["/v1/rl/training/runs"]


async def test_no_leader_within_the_failover_wait_is_503(monkeypatch) -> None:
    monkeypatch.setattr(forward, "FAILOVER_WAIT_S", 0.3)

    async def none() -> Holder | None:
        return None

    async with client(LeaderForwarding(local_app([]), is_leader=lambda: False, leader=none)) as c:
        began = time.monotonic()
        r = await c.post("/v1/rl/training/runs")
        assert time.monotonic() - began >= 0.3
    assert (r.status_code, r.json()["error"]["code"]) == (503, "service_not_ready")


async def test_a_relayed_request_is_never_relayed_again() -> None:
    async def somewhere() -> Holder:
        raise AssertionError("not looked up")

    async with client(LeaderForwarding(local_app([]), is_leader=lambda: False, leader=somewhere)) as c:
        r = await c.post("/v1/rl/training/runs", headers={"x-rl-forwarded": "1"})
    assert (r.status_code, r.json()["error"]["code"]) == (503, "service_not_ready")


async def test_a_refused_leader_port_is_waited_out_until_the_new_leader_answers() -> None:
    """The lease still names a dead leader (connection refused: nothing was read), then a new one holds it."""
    dead, port = free_port(), free_port()
    leader = Leader(port)
    handover = asyncio.get_running_loop().time() + 0.5

    async def where() -> Holder:
        if asyncio.get_running_loop().time() < handover:
            return Holder("b", 0, 1, dead)
        return Holder("b", 2, 3, port)

    async def start_later() -> None:
        await asyncio.sleep(0.4)
        await leader.server.astart()

    starter = asyncio.create_task(start_later())
    try:
        async with client(LeaderForwarding(local_app([]), is_leader=lambda: False, leader=where)) as c:
            r = await c.post("/v1/rl/training/runs")
        assert r.status_code == 201 and len(leader.seen) == 1
    finally:
        await starter
        await leader.server.astop()


async def test_a_leader_that_dies_with_the_request_is_not_asked_again() -> None:
    """The outcome of a request the leader read is unknown once its answer is lost: 503, never a second try."""
    reads = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal reads
        await reader.readuntil(b"\r\n\r\n")
        reads += 1
        writer.transport.abort()  # a reset instead of an answer

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def where() -> Holder:
        return Holder("b", 0, 1, port)

    try:
        async with client(LeaderForwarding(local_app([]), is_leader=lambda: False, leader=where)) as c:
            r = await c.post("/v1/rl/training/runs")
        assert (r.status_code, r.json()["error"]["code"]) == (503, "service_not_ready")
        assert reads == 1
    finally:
        server.close()
        await server.wait_closed()
