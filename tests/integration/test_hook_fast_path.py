"""The hooks' lean ASGI path (online/api/hook_fast_path.py) answers exactly what the FastAPI stack answers.

Each case runs twice on a fresh app over the same fresh Redis state: once as served (the fast path in front), once
with the fast path taken out (`app.hook_fast_path = None`: the routes, middlewares and handlers of FastAPI). The two
runs must send the same ASGI messages (status, every header in order, body bytes, framing), count the same metrics
(`rl_http_requests_total` by route and status, hook durations, capture results, Redis errors), log the same
unhandled errors and leave the same Task. Each case also states the answer it expects, so an equal mistake in both
paths still fails. A last test compares the raw bytes on a real uvicorn socket.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from openjiuwen.agent_evolving.agent_rl.common.packed_hook import MEDIA_TYPE, pack_after
from openjiuwen.agent_evolving.agent_rl.common.sampling import DEFAULTS
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.conftest import load_fixture
from tests.support.service_app import make_config, running_app, start_headers

TOKEN = "fast-path-token-51c2"
AUTH = (b"authorization", f"Bearer {TOKEN}".encode())
JSON = (b"content-type", b"application/json")
PACKED = (b"content-type", MEDIA_TYPE.encode())
BEFORE, AFTER, DISCARD = ("/internal/v1/completions:before", "/internal/v1/completions:after",
                          "/internal/v1/completions:discard")
LIMIT = 4096
REQUEST, RESPONSE = load_fixture("chat_request.json"), load_fixture("chat_response.json")
LOOPBACK = ("127.0.0.1", 8000)


def hook(c: str = "c1", t: str = "t1", **extra: Any) -> dict[str, Any]:
    return {"rl_task_id": t, "capture_id": c, "agent_turn_id": None, **extra}


def injected(request: dict[str, Any]) -> dict[str, Any]:
    """What `:before` returns: every sampling field named, the client's `top_logprobs` kept (it asked for logprobs)."""
    out = {**DEFAULTS, **request}
    out.update(logprobs=True, top_logprobs=request["top_logprobs"] if request.get("logprobs") else 0,
               return_token_ids=True)
    return out


def packed(c: str = "c1", response: dict[str, Any] = RESPONSE) -> bytes:
    body = pack_after(orjson.dumps(hook(c, request=injected(REQUEST))), response)
    assert body is not None
    return body


def json_body(value: Any) -> bytes:
    return orjson.dumps(value)


# ------------------------------------------------------------------------------------------------------ harness


@dataclass
class Exchange:
    path: str
    body: list[bytes]  # the body's messages (several: a chunked body)
    headers: list[tuple[bytes, bytes]] = field(default_factory=lambda: [AUTH, JSON])
    sized: bool = True  # send Content-Length (else Transfer-Encoding: chunked)
    method: str = "POST"
    server: tuple[str, int] = LOOPBACK
    disconnect: bool = False  # the client goes away after the body's messages (more_body stays true)
    length: bytes | None = None  # a Content-Length to declare instead of the body's


async def _asgi(app: Any, ex: Exchange) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    total = sum(len(b) for b in ex.body)
    headers = list(ex.headers)
    headers.insert(0, (b"host", b"rl.test"))
    length = ex.length if ex.length is not None else str(total).encode()
    headers.append((b"content-length", length) if ex.sized else (b"transfer-encoding", b"chunked"))
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": ex.method, "scheme": "http", "path": ex.path, "raw_path": ex.path.encode(), "root_path": "",
        "query_string": b"", "headers": headers, "client": ("127.0.0.1", 50000), "server": ex.server,
    }
    queue = [{"type": "http.request", "body": b, "more_body": ex.disconnect or i < len(ex.body) - 1}
             for i, b in enumerate(ex.body)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(copy.deepcopy(message))

    try:
        await app(scope, receive, send)
    except Exception as exc:  # an exception escaping the app reaches the server (neither path should)
        sent.append({"raised": type(exc).__name__})
    return sent, scope


def _metrics(app: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in app.state.deps.metrics.registry.collect():
        if not family.name.startswith(("rl_http_requests", "rl_hook_duration_seconds", "rl_captures",
                                       "rl_redis_errors")):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_sum", "_created")):
                continue  # durations differ between runs; their counts do not
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def _wipe(redis: Redis) -> None:
    async for key in redis.scan_iter(match="rl:v1:*", count=1000):
        await redis.delete(key)


Setup = Callable[[Any, Any], Awaitable[None]]


async def _run(redis: Redis, redis_url: str, tmp_path: Any, setup: Setup, ex: Exchange, *, fast: bool,
               caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    await _wipe(redis)
    caplog.clear()
    config = make_config(redis_url, tmp_path, max_body_bytes=LIMIT)
    async with running_app(config, token=TOKEN) as (app, client):
        client.headers["authorization"] = f"Bearer {TOKEN}"
        await setup(app, client)
        before_metrics = _metrics(app)
        served = _Counting(app.hook_fast_path)
        app.hook_fast_path = served if fast else None
        sent, _ = await _asgi(app, ex)
        after_metrics = _metrics(app)
        task = await redis.get(keys.task("t1"))
    record = orjson.loads(task) if task else None
    if record:
        for stamp in ("created_at", "finished_at"):
            record[stamp] = bool(record[stamp])
    return {
        "sent": sent,
        "metrics": {k: v - before_metrics.get(k, 0.0) for k, v in after_metrics.items()
                    if v != before_metrics.get(k, 0.0)},
        "unhandled": [r.getMessage() for r in caplog.records if r.getMessage().startswith("unhandled error")],
        "task": record,
        "fast_path_calls": served.calls,
    }


class _Counting:
    """The fast path, counting the requests it served."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def serves(self, scope: dict[str, Any]) -> bool:
        return self.inner.serves(scope)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        await self.inner(scope, receive, send)


async def both(redis, redis_url, tmp_path, caplog, setup: Setup, ex: Exchange) -> dict[str, Any]:
    """The answer of the fast path, after checking the FastAPI stack's is the same in every respect."""
    fast = await _run(redis, redis_url, tmp_path, setup, ex, fast=True, caplog=caplog)
    slow = await _run(redis, redis_url, tmp_path, setup, ex, fast=False, caplog=caplog)
    assert (fast["fast_path_calls"], slow["fast_path_calls"]) == (1, 0), "the fast path did not serve the request"
    for key in ("sent", "metrics", "unhandled", "task"):
        assert fast[key] == slow[key], (key, fast[key], slow[key])
    return fast


def answer(result: dict[str, Any]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    sent = result["sent"]
    start = sent[0]
    assert start["type"] == "http.response.start", sent
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], start["headers"], body


def error(result: dict[str, Any]) -> tuple[int, str, str]:
    status, headers, body = answer(result)
    assert dict(headers)[b"content-type"] == b"application/json"
    err = orjson.loads(body)["error"]
    return status, err["code"], err["message"]


# --------------------------------------------------------------------------------------------------- setups


async def nothing(app: Any, client: Any) -> None:
    pass


async def active_task(app: Any, client: Any) -> None:
    r = await client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"}, headers=start_headers("s1", "t1"))
    assert r.status_code == 201, r.text


async def stopped_task(app: Any, client: Any) -> None:
    await active_task(app, client)
    assert (await client.post("/v1/rl/tasks/t1/stop")).status_code == 200


async def reserved(app: Any, client: Any) -> None:
    await active_task(app, client)
    r = await client.post(BEFORE, json=hook(request=REQUEST))
    assert r.status_code == 200, r.text


async def committed(app: Any, client: Any) -> None:
    await reserved(app, client)
    r = await client.post(AFTER, json=hook(request=injected(REQUEST), response=RESPONSE))
    assert r.status_code == 204, r.text


# ---------------------------------------------------------------------------------------------------- cases


@pytest.fixture
def run(redis, redis_url, tmp_path, caplog):
    caplog.set_level(logging.WARNING)

    async def go(setup: Setup, ex: Exchange) -> dict[str, Any]:
        return await both(redis, redis_url, tmp_path, caplog, setup, ex)

    return go


async def test_success_and_idempotent_repeats(run):
    first = await run(active_task, Exchange(BEFORE, [json_body(hook(request=REQUEST))]))
    status, headers, body = answer(first)
    assert status == 200 and orjson.loads(body) == {"request": injected(REQUEST)}
    assert headers == [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
    assert first["metrics"][("rl_http_requests_total", (("model_id", "tiny"), ("route", BEFORE),
                                                        ("status", "200")))] == 1
    again = await run(reserved, Exchange(BEFORE, [json_body(hook(request=REQUEST))]))
    assert answer(again) == (status, headers, body)

    after = json_body(hook(request=injected(REQUEST), response=RESPONSE))
    for setup in (reserved, committed):  # commit, then the idempotent repeat
        result = await run(setup, Exchange(AFTER, [after]))
        assert answer(result) == (204, [], b"")
    assert (await run(reserved, Exchange(AFTER, [packed()], headers=[AUTH, PACKED])))["sent"][0]["status"] == 204
    assert answer(await run(reserved, Exchange(DISCARD, [json_body(hook())]))) == (204, [], b"")
    assert answer(await run(active_task, Exchange(DISCARD, [json_body(hook())]))) == (204, [], b"")  # unknown: no-op


async def test_bearer_token(run):
    body = [json_body(hook(request=REQUEST))]
    for headers in ([JSON], [(b"authorization", b"Bearer wrong"), JSON], [(b"authorization", TOKEN.encode()), JSON]):
        result = await run(active_task, Exchange(BEFORE, body, headers=headers))
        assert error(result) == (401, "unauthorized", "missing or invalid bearer token")
        assert answer(result)[1][0] == (b"content-type", b"application/json")  # the guard's own header order
        assert ("rl_http_requests_total", (("model_id", "tiny"), ("route", "unmatched"), ("status", "401"))) in \
            result["metrics"]


async def test_body_limit(run):
    big = json_body(hook(request={**REQUEST, "pad": "x" * LIMIT}))
    declared = await run(active_task, Exchange(BEFORE, [big]))
    assert error(declared) == (413, "payload_too_large", f"request body exceeds {LIMIT} bytes")
    assert (b"connection", b"close") in answer(declared)[1]
    chunked = await run(active_task, Exchange(AFTER, [big[:3000], big[3000:]], sized=False))
    assert error(chunked) == (413, "payload_too_large", f"request body exceeds {LIMIT} bytes")
    assert (b"connection", b"close") in answer(chunked)[1]
    assert chunked["metrics"][("rl_captures_total", (("model_id", "tiny"), ("result", "rejected")))] == 1
    small_chunks = await run(reserved, Exchange(DISCARD, [b'{"rl_task_id": "t1", ', b'"capture_id": "c1"}'],
                                                sized=False))
    assert answer(small_chunks) == (204, [], b"")
    bad_length = await run(active_task, Exchange(BEFORE, [b"{}"], length=b"1x"))
    assert error(bad_length) == (400, "invalid_request", "invalid Content-Length")


async def test_loopback_only(run):
    result = await run(active_task, Exchange(BEFORE, [json_body(hook(request=REQUEST))], server=("10.1.2.3", 8000)))
    assert error(result) == (403, "forbidden", "the RL Service serves loopback clients only")


async def test_content_types(run):
    body = [json_body(hook(request=REQUEST))]
    for path, content_type in ((BEFORE, b"text/plain"), (BEFORE, MEDIA_TYPE.encode()), (DISCARD, b""),
                               (AFTER, b"application/x-www-form-urlencoded")):
        result = await run(active_task, Exchange(path, body, headers=[AUTH, (b"content-type", content_type)]))
        assert error(result)[:2] == (415, "unsupported_media_type"), (path, content_type)
    for content_type in (b"application/json; charset=utf-8", b"application/vnd.test+json"):
        result = await run(active_task, Exchange(BEFORE, body, headers=[AUTH, (b"content-type", content_type)]))
        assert answer(result)[0] == 200
    # A repeated Content-Type: the first one counts (as the routes read it).
    twice = await run(active_task, Exchange(BEFORE, body, headers=[AUTH, JSON, (b"content-type", b"text/plain")]))
    assert answer(twice)[0] == 200


async def test_bad_bodies(run):
    for raw, code, message in (
        (b"{not json", "invalid_request", "request body is not valid JSON"),
        (b"[1, 2]", "invalid_request", "request body must be a JSON object"),
        (b"  ", "invalid_request", "request body must be a JSON object"),
        (json_body(hook()), "invalid_completion", "missing field: request"),
        (json_body({**hook(request=REQUEST), "capture_id": "bad id"}), "invalid_completion",
         "capture_id has an invalid format"),
        (json_body(hook(request={**REQUEST, "model": "other"})), "completion_conflict",
         "request model does not match Task policy"),
    ):
        result = await run(active_task, Exchange(BEFORE, [raw]))
        assert error(result) == ((409 if code == "completion_conflict" else 400), code, message), raw
        assert result["task"]["status"] == "active"  # input errors at `:before` never abort


async def test_unknown_and_inactive_tasks_and_conflicts(run):
    body = [json_body(hook(request=REQUEST))]
    assert error(await run(nothing, Exchange(BEFORE, body))) == (404, "completion_conflict", "RL Task not found")
    assert error(await run(nothing, Exchange(DISCARD, [json_body(hook())])))[:2] == (404, "completion_conflict")
    assert error(await run(stopped_task, Exchange(BEFORE, body))) == (409, "completion_conflict",
                                                                      "RL Task is not active")
    other = [json_body(hook(request={**REQUEST, "max_tokens": 7}))]
    assert error(await run(reserved, Exchange(BEFORE, other))) == (
        409, "completion_conflict", "capture_id already used with different input")
    no_before = await run(active_task, Exchange(AFTER, [json_body(hook(request=injected(REQUEST),
                                                                        response=RESPONSE))]))
    assert error(no_before) == (409, "completion_conflict", "capture has no matching before")
    assert no_before["task"]["status"] == "aborted"  # every `:after` rejection past the shape aborts
    assert error(await run(committed, Exchange(DISCARD, [json_body(hook())]))) == (
        409, "completion_conflict", "capture is already committed")
    different = {**RESPONSE, "id": "chatcmpl-other"}
    assert error(await run(committed, Exchange(AFTER, [json_body(hook(request=injected(REQUEST),
                                                                        response=different))]))) == (
        409, "completion_conflict", "capture already committed with a different response")


async def test_packed_body_errors(run):
    for raw, expected in (
        (b"RLH1", (400, "invalid_request", "packed body shorter than its header")),
        (b"XXXX" + packed()[4:], (400, "invalid_request", "packed body has an unknown magic")),
        (packed()[:-1], (400, "invalid_request", "packed body length does not match its header")),
    ):
        result = await run(reserved, Exchange(AFTER, [raw], headers=[AUTH, PACKED]))
        assert error(result) == expected
    with_arrays = packed()
    head = orjson.loads(with_arrays[16:16 + int.from_bytes(with_arrays[4:8], "little")])
    head["response"]["prompt_token_ids"] = [1]
    meta = orjson.dumps(head)
    forged = with_arrays[:4] + len(meta).to_bytes(4, "little") + with_arrays[8:16] + meta + \
        with_arrays[16 + int.from_bytes(with_arrays[4:8], "little"):]
    result = await run(reserved, Exchange(AFTER, [forged], headers=[AUTH, PACKED]))
    assert error(result)[:2] == (400, "invalid_completion")
    assert result["task"]["status"] == "aborted"


async def test_unhandled_errors_are_the_500_envelope(run, monkeypatch):
    internal = (500, "internal_error", "internal service error")

    async def boom(*_: Any, **__: Any) -> None:
        raise RuntimeError("boom: a detail only the log may show")

    async def redis_down(*_: Any, **__: Any) -> None:
        raise RedisConnectionError("redis went away")

    async def patched(app: Any, client: Any, name: str, fn: Any) -> None:
        await active_task(app, client)
        monkeypatch.setattr(app.state.deps.ledger, name, fn)

    result = await run(lambda app, client: patched(app, client, "reserve", boom),
                       Exchange(BEFORE, [json_body(hook(request=REQUEST))]))
    assert error(result) == internal
    assert result["unhandled"] == [f"unhandled error on POST {BEFORE}"]
    assert ("rl_http_requests_total", (("model_id", "tiny"), ("route", BEFORE), ("status", "500"))) in \
        result["metrics"]
    result = await run(lambda app, client: patched(app, client, "discard", redis_down),
                       Exchange(DISCARD, [json_body(hook())]))
    assert error(result) == internal
    assert result["metrics"][("rl_redis_errors_total", (("model_id", "tiny"),))] == 1
    gone = await run(active_task, Exchange(BEFORE, [b'{"rl_task_id": '], disconnect=True))  # ClientDisconnect
    assert error(gone) == internal and gone["unhandled"] == [f"unhandled error on POST {BEFORE}"]


async def test_other_methods_and_paths_go_to_fastapi(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path), token=TOKEN) as (app, _):
        for ex in (Exchange(BEFORE, [b""], method="GET"), Exchange(BEFORE + "/", [b"{}"]),
                   Exchange("/internal/v1/completions:other", [b"{}"])):
            sent, scope = await _asgi(app, ex)
            assert "route" in scope or sent[0]["status"] == 404
            assert sent[0]["status"] in (404, 405)


async def test_hooks_go_through_fastapi_while_its_telemetry_is_on(redis, redis_url, tmp_path, monkeypatch):
    async with running_app(make_config(redis_url, tmp_path), token=TOKEN) as (app, client):
        client.headers["authorization"] = f"Bearer {TOKEN}"
        await active_task(app, client)
        served = _Counting(app.hook_fast_path)
        app.hook_fast_path = served
        sent, _ = await _asgi(app, Exchange(BEFORE, [json_body(hook(request=REQUEST))]))
        assert (sent[0]["status"], served.calls) == (200, 1)
        monkeypatch.setattr(app._native_telemetry, "enabled", lambda: True)  # a provider configured meanwhile
        sent, scope = await _asgi(app, Exchange(BEFORE, [json_body(hook(request=REQUEST))]))
        assert (sent[0]["status"], served.calls) == (200, 1) and "route" in scope  # routed by FastAPI


# ------------------------------------------------------------------------------------------------- real socket


async def _raw(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(10):
            data = await reader.read()  # every request says `Connection: close`
    finally:
        writer.close()
    # The Date header is the only thing two answers of one server may differ in.
    return b"\r\n".join(line for line in data.split(b"\r\n") if not line.lower().startswith(b"date:"))


async def test_same_bytes_on_a_real_socket(redis, redis_url, tmp_path):
    from tests.integration.test_guards_and_health import on_socket

    def request(path: str, body: bytes, *, auth: bool = True, content_type: bytes = b"application/json") -> bytes:
        head = [f"POST {path} HTTP/1.1".encode(), b"host: rl", b"connection: close",
                b"content-type: " + content_type, f"content-length: {len(body)}".encode()]
        if auth:
            head.append(b"authorization: Bearer " + TOKEN.encode())
        return b"\r\n".join(head) + b"\r\n\r\n" + body

    exchanges = [
        request(BEFORE, json_body(hook(request=REQUEST))),
        request(BEFORE, json_body(hook(request=REQUEST))),  # the idempotent repeat
        request(AFTER, json_body(hook(request=injected(REQUEST), response=RESPONSE))),
        request(BEFORE, json_body(hook(request=REQUEST)), auth=False),
        request(BEFORE, b"{}", content_type=b"text/plain"),
        request(BEFORE, b"{nope"),
        request(DISCARD, json_body(hook("c9", t="t404"))),
        request(BEFORE, json_body(hook(request={**REQUEST, "pad": "x" * LIMIT}))),
    ]
    answers = {}
    for fast in (True, False):
        await _wipe(redis)
        async with on_socket(make_config(redis_url, tmp_path, max_body_bytes=LIMIT), token=TOKEN) as (app, url):
            if not fast:
                app.hook_fast_path = None
            import httpx

            async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {TOKEN}"}) as client:
                assert (await client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                                          headers=start_headers("s1", "t1"))).status_code == 201
            answers[fast] = [await _raw(url, r) for r in exchanges]
    assert answers[True] == answers[False]
    statuses = [a.split(b"\r\n", 1)[0] for a in answers[True]]
    assert statuses == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", b"HTTP/1.1 204 No Content",
                        b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 415 Unsupported Media Type",
                        b"HTTP/1.1 400 Bad Request", b"HTTP/1.1 404 Not Found",
                        b"HTTP/1.1 413 Request Entity Too Large"]
