"""Global HTTP rules (CONTRACT §2.1) and `/health` (§2.3): auth, body limit, generic codes, the 500 envelope.

In-process through ASGI where that is the behaviour under test, and on a real loopback socket (uvicorn in this
event loop) where the HTTP framing matters: a huge Content-Length with no body, a chunked body that never ends.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn
from fastapi import FastAPI
from redis.asyncio import Redis

from openjiuwen.agent_evolving.agent_rl.common import request_guards
from openjiuwen.agent_evolving.agent_rl.online.config import RLServiceConfig
from openjiuwen.agent_evolving.agent_rl.online.service import create_app
from tests.support.redis_server import RedisServer
from tests.support.service_app import make_config, running_app, start_headers

LIMIT = 1024
TOKEN = "guard-token-3b8e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INTERNAL_ERROR = {"error": {"code": "internal_error", "message": "internal service error"}}


def envelope_code(resp: httpx.Response) -> tuple[int, str]:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    assert isinstance(body["error"]["message"], str)
    return resp.status_code, body["error"]["code"]


def quiet_client(app: FastAPI) -> httpx.AsyncClient:
    """An ASGI client that returns the 500 the app sent instead of re-raising the app's exception."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://rl.test", timeout=30,
                             headers={"content-type": "application/json"})  # as the gateway sends


@asynccontextmanager
async def on_socket(config: RLServiceConfig, **kwargs: object) -> AsyncIterator[tuple[FastAPI, str]]:
    """The app served by uvicorn on a free loopback port in this event loop, lifespan included."""
    app = create_app(config, redis=Redis.from_url(config.redis_url.get_secret_value()), **kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:  # uvicorn has no start event; bounded, startup only
                if serving.done():
                    serving.result()
                    raise RuntimeError("uvicorn stopped during startup")
                await asyncio.sleep(0.01)
        yield app, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(15):
            await serving
        sock.close()


async def raw_exchange(url: str, head: bytes, body_parts: list[bytes], timeout_s: float = 5.0) -> bytes:
    """Send a request head and body parts over a plain socket, leave it open, and read the response head."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        for part in body_parts:
            writer.write(part)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            head_bytes = await reader.readuntil(b"\r\n\r\n")
            lines = head_bytes.split(b"\r\n")
            length = int(next(line.split(b":", 1)[1] for line in lines if line.lower().startswith(b"content-length:")))
            return head_bytes + await reader.readexactly(length)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def split_response(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(body)


@pytest.fixture
def limited(redis, redis_url, tmp_path: Path) -> RLServiceConfig:
    return make_config(redis_url, tmp_path, max_body_bytes=LIMIT)


# --------------------------------------------------------------------------------------------------------- health


async def test_health_ready(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (_, client):
        r = await client.get("/health")
        assert (r.status_code, r.json()) == (200, {"status": "ready", "model_id": "tiny",
                                              "hook_encodings": ["json", "packed-v1"]})
        assert r.headers["content-type"].startswith("application/json")


async def test_health_503_when_redis_is_unreachable(tmp_path):
    # A Redis of its own, so pausing and stopping it never disturbs the session's server.
    own = RedisServer(tmp_path / "own-redis").start()
    try:
        async with running_app(make_config(own.url, tmp_path)) as (_, client):
            assert (await client.get("/health")).status_code == 200
            own.pause()  # a hung Redis: the health check must still answer, bounded by its own timeout
            try:
                began = time.monotonic()
                r = await client.get("/health")
                assert envelope_code(r) == (503, "service_not_ready")
                assert time.monotonic() - began < 5
            finally:
                own.resume()
            assert (await client.get("/health")).status_code == 200
            own.stop()  # a dead Redis: refused connections
            r = await client.get("/health")
            assert envelope_code(r) == (503, "service_not_ready")
            assert "redis" in r.json()["error"]["message"].lower()
    finally:
        own.stop()


# ----------------------------------------------------------------------------------------------------- body limit


async def test_body_limit_from_content_length(limited):
    async with running_app(limited) as (_, client):
        h = start_headers("s1", "t1")
        big = orjson.dumps({"reward_mode": "terminal", "pad": "x" * 2 * LIMIT})
        r = await client.post("/v1/rl/tasks/start", content=big, headers=h)
        assert int(r.request.headers["content-length"]) > LIMIT
        assert envelope_code(r) == (413, "payload_too_large")
        # Size is decided before the body is parsed or the route runs: malformed JSON, any route.
        for path in ("/v1/rl/tasks/t1/reward", "/internal/v1/completions:before", "/v1/gateway/upload/batch"):
            r = await client.post(path, content=b"{" * (LIMIT + 1))
            assert envelope_code(r) == (413, "payload_too_large"), path
        # Exactly at the limit passes the guard and reaches the route's own rules.
        at_limit = b'{"reward_mode": "terminal"}'.ljust(LIMIT, b" ")
        r = await client.post("/v1/rl/tasks/start", content=at_limit, headers=h)
        assert r.status_code == 201
        assert (await client.get("/v1/rl/tasks/t1")).status_code == 200  # a GET without a body is unaffected


async def test_body_limit_while_reading_a_chunked_body(limited, monkeypatch):
    # After the 413 the guard reads on (and discards) what the client still sends, within DRAIN_BYTES; a small
    # bound here shows both the early decision and that bound.
    monkeypatch.setattr(request_guards, "DRAIN_BYTES", 1024)
    async with running_app(limited) as (_, client):
        sent = 0

        async def endless() -> AsyncIterator[bytes]:
            nonlocal sent
            yield b'{"reward_mode": "terminal", "pad": "'
            for _ in range(100):
                sent += 1
                yield b"x" * 256

        request = client.build_request(
            "POST", "/v1/rl/tasks/start", content=endless(), headers=start_headers("s1", "t1")
        )
        assert request.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in request.headers
        r = await client.send(request)
        assert envelope_code(r) == (413, "payload_too_large")
        assert sent < 100  # decided while reading, not after the whole body; the drain stopped at its bound
        assert (await client.get("/v1/rl/tasks/t1")).status_code == 404

        async def small() -> AsyncIterator[bytes]:
            yield b'{"reward_mode": '
            yield b'"terminal"}'

        request = client.build_request("POST", "/v1/rl/tasks/start", content=small(), headers=start_headers("s1", "t1"))
        assert "content-length" not in request.headers
        assert (await client.send(request)).status_code == 201  # a chunked body under the limit is served


async def test_body_limit_on_a_real_socket(limited):
    async with on_socket(limited) as (_, url):
        # A huge Content-Length with no body sent at all: answered from the header alone.
        head = (
            b"POST /v1/rl/tasks/start HTTP/1.1\r\nHost: rl\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        status, body = split_response(await raw_exchange(url, head, []))
        assert (status, body["error"]["code"]) == (413, "payload_too_large")
        # A chunked body that never ends: answered once the limit is passed.
        head = (b"POST /internal/v1/completions:before HTTP/1.1\r\nHost: rl\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"200\r\n" + b"[" * 0x200 + b"\r\n"
        status, body = split_response(await raw_exchange(url, head, [chunk] * 3))
        assert (status, body["error"]["code"]) == (413, "payload_too_large")
        # The server still serves normally afterwards.
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/health")).status_code == 200


# ------------------------------------------------------------------------------------------- auth, order, generic


async def test_auth_then_size_then_route(limited):
    async with running_app(limited, token=TOKEN) as (_, client):
        big = b"x" * (LIMIT * 4)
        # Without (or with a wrong) bearer, an oversized request is 401, not 413; an unknown route is 401, not 404.
        for headers in ({}, {"Authorization": "Bearer nope"}):
            assert envelope_code(await client.post("/v1/rl/tasks/start", content=big, headers=headers)) == (
                401, "unauthorized",
            )
            assert envelope_code(await client.get("/no/such/route", headers=headers)) == (401, "unauthorized")
        # Authenticated: size before route and before JSON parsing.
        assert envelope_code(await client.post("/v1/rl/tasks/start", content=big, headers=AUTH)) == (
            413, "payload_too_large",
        )
        assert envelope_code(await client.post("/no/such/route", content=big, headers=AUTH)) == (
            413, "payload_too_large",
        )
        assert envelope_code(await client.post("/no/such/route", content=b"{}", headers=AUTH)) == (
            404, "request_failed",
        )
        assert envelope_code(await client.post("/v1/rl/tasks/start", content=b"{", headers=AUTH)) == (
            400, "invalid_request",
        )
        # /health needs no token; any other method on it does.
        assert (await client.get("/health")).status_code == 200
        assert envelope_code(await client.post("/health")) == (401, "unauthorized")
        r = await client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                              headers={**AUTH, **start_headers("s1", "t1")})
        assert r.status_code == 201
        assert TOKEN not in r.text


async def test_framework_errors_use_request_failed(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (_, client):
        r = await client.get("/v1/rl/no-such-thing")
        assert envelope_code(r) == (404, "request_failed")
        assert r.json()["error"]["message"] == "Not Found"
        r = await client.get("/v1/rl/tasks/start")  # matched by /v1/rl/tasks/{id}: an unknown Task
        assert envelope_code(r) == (404, "task_not_found")
        # A trailing slash is another, unknown path: no redirect to the listing or to the route without it.
        for method, path in (("GET", "/v1/rl/trajectories/"), ("POST", "/v1/rl/tasks/start/"), ("GET", "/health/")):
            r = await client.request(method, path)
            assert envelope_code(r) == (404, "request_failed"), (method, path)
        for method, path in (("GET", "/internal/v1/completions:before"), ("DELETE", "/v1/rl/tasks/t1"),
                             ("POST", "/v1/rl/trajectories/stats"), ("PUT", "/health")):
            r = await client.request(method, path)
            assert envelope_code(r) == (405, "request_failed"), (method, path)
            assert r.json()["error"]["message"] == "Method Not Allowed"


async def test_invalid_content_length_header_is_400(limited):
    """Servers normally refuse this framing themselves; an ASGI caller can still hand it to the guard."""
    async with running_app(limited) as (app, _):
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/rl/tasks/start", "raw_path": b"/v1/rl/tasks/start", "root_path": "", "query_string": b"",
            "headers": [(b"host", b"rl"), (b"content-length", b"12abc")], "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        await app(scope, receive, send)
        assert sent[0]["status"] == 400
        assert orjson.loads(sent[1]["body"])["error"]["code"] == "invalid_request"


# ------------------------------------------------------------------------------------------------------------ 500


def _boom(*_: object, **__: object) -> None:
    raise RuntimeError("boom: secret detail that must stay in the log")


async def test_unexpected_exception_is_exactly_the_500_envelope(redis, redis_url, tmp_path, monkeypatch):
    async with running_app(make_config(redis_url, tmp_path)) as (app, _), quiet_client(app) as client:
        deps = app.state.deps
        monkeypatch.setattr(deps.registry, "require", _boom)
        monkeypatch.setattr(deps.ledger, "discard", _boom)  # `:discard` reads no Task first (its script does)
        monkeypatch.setattr(deps.samples.stats, "stats", _boom)
        for method, path, body in (
            ("GET", "/v1/rl/tasks/t1", None),
            ("POST", "/v1/rl/tasks/t1/stop", None),
            ("GET", "/v1/rl/trajectories/stats", None),
            ("POST", "/internal/v1/completions:discard", {"rl_task_id": "t1", "capture_id": "c1"}),
        ):
            r = await client.request(method, path, json=body)
            assert (r.status_code, r.json()) == (500, INTERNAL_ERROR), path
            assert "boom" not in r.text


async def test_500_envelope_on_a_real_socket(redis, redis_url, tmp_path, monkeypatch):
    async with on_socket(make_config(redis_url, tmp_path)) as (app, url):
        monkeypatch.setattr(app.state.deps.registry, "require", _boom)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            r = await client.get("/v1/rl/tasks/t1")
            assert (r.status_code, r.json()) == (500, INTERNAL_ERROR)
            assert r.headers["content-type"].startswith("application/json")
            assert (await client.get("/health")).status_code == 200  # one failure does not take the server down
