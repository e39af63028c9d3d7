"""Fuzzed bodies, headers, path ids and query parameters on every route never give a 5xx, and every non-2xx answer
is exactly the envelope `{"error": {"code": str, "message": str}}` (CONTRACT §2.1, §9 "fuzzed bodies and headers").

One in-process app (lifespan included, a fake Judge on a real socket) serves the whole module from its own event
loop. Its Redis state is seeded once over HTTP and restored from a DUMP snapshot before every example, so each
example (and its shrinking) sees the same Tasks: an active Task with a committed and an open capture, a rewarded
one with a published sample, an empty active one and a delayed-feedback one with a committed turn.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import Redis as SyncRedis

from tests.conftest import load_fixture
from tests.support.fake_judge import FakeJudge
from tests.support.service_app import make_config, running_app, start_headers

SETTINGS = settings(
    max_examples=60, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")
INJECTED = dict(REQUEST, logprobs=True, top_logprobs=0, return_token_ids=True)


@dataclass
class Req:
    method: str
    path: str
    content: bytes | None = None
    headers: dict[str, bytes] = field(default_factory=dict)
    params: list[tuple[str, str]] = field(default_factory=list)


class FuzzApp:
    """The app, its client and a Redis snapshot to restore, all driven from one private event loop."""

    def __init__(self, runner: asyncio.Runner, client: httpx.AsyncClient, redis: SyncRedis) -> None:
        self.runner, self.client, self.redis = runner, client, redis
        self.snapshot: list[tuple[bytes, int, bytes]] = []

    def take_snapshot(self) -> None:
        self.snapshot = [
            (k, max(self.redis.pttl(k), 0), self.redis.dump(k)) for k in self.redis.scan_iter(match="rl:v1:*")
        ]

    def restore(self) -> None:
        pipe = self.redis.pipeline(transaction=True)
        for key in self.redis.scan_iter(match="rl:v1:*"):
            pipe.delete(key)
        for key, ttl, value in self.snapshot:
            pipe.restore(key, ttl, value, replace=True)
        pipe.execute()

    def send(self, req: Req) -> httpx.Response:
        return self.runner.run(
            self.client.request(req.method, req.path, content=req.content, headers=req.headers, params=req.params)
        )


def check(req: Req, resp: httpx.Response) -> None:
    body = req.content[:300] if req.content else req.content
    where = f"{req.method} {req.path} params={req.params} headers={req.headers} body={body!r}"
    assert resp.status_code < 500, f"{resp.status_code} {resp.text[:300]} for {where}"
    if resp.status_code == 204:
        assert resp.content == b""
        return
    body = resp.json()
    if resp.status_code >= 300:
        assert isinstance(body, dict) and set(body) == {"error"}, where
        assert isinstance(body["error"], dict) and set(body["error"]) == {"code", "message"}, where
        assert isinstance(body["error"]["code"], str) and isinstance(body["error"]["message"], str), where
    else:
        assert isinstance(body, dict), where


def _clean(redis: SyncRedis) -> None:
    for key in redis.scan_iter(match="rl:v1:*"):
        redis.delete(key)


async def _seed(client: httpx.AsyncClient) -> None:
    async def ok(resp_coro: Any, status: int) -> httpx.Response:
        resp = await resp_coro
        assert resp.status_code == status, resp.text
        return resp

    async def capture(t: str, c: str, turn: str | None = None, commit: bool = True) -> None:
        body = {"rl_task_id": t, "capture_id": c, "agent_turn_id": turn, "request": REQUEST}
        before = await ok(client.post("/internal/v1/completions:before", json=body), 200)
        if commit:
            body = dict(body, request=before.json()["request"], response=RESPONSE)
            await ok(client.post("/internal/v1/completions:after", json=body), 204)

    start = "/v1/rl/tasks/start"
    await ok(client.post(start, json={"reward_mode": "terminal"}, headers=start_headers("s1", "t1")), 201)
    await capture("t1", "c1")
    await capture("t1", "c2", commit=False)
    await ok(client.post(start, json={"reward_mode": "terminal"}, headers=start_headers("s2", "t2")), 201)
    await capture("t2", "c3")
    await ok(client.post("/v1/rl/tasks/t2/stop"), 200)
    await ok(client.post("/v1/rl/tasks/t2/reward", json={"reward": 0.5}), 200)
    await ok(client.post(start, json={"reward_mode": "terminal"}, headers=start_headers("s3", "t3")), 201)
    await ok(client.post(start, json={"reward_mode": "delayed_feedback"}, headers=start_headers("s4", "t4")), 201)
    await capture("t4", "c4", turn="u1")


@pytest.fixture(scope="module")
def fuzz(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzApp]:
    tmp = tmp_path_factory.mktemp("fuzz")
    redis = SyncRedis.from_url(redis_url)
    _clean(redis)
    with FakeJudge() as judge, asyncio.Runner() as runner:
        config = make_config(redis_url, tmp, judge_endpoint=judge.url, judge_model="judge", judge_retries=0,
                             judge_timeout=5.0, turn_publish_timeout_seconds=1.0)
        apps = running_app(config)
        app, _ = runner.run(apps.__aenter__())
        try:
            # The 500 handler re-raises after answering; this client returns that answer instead of raising.
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            client = httpx.AsyncClient(transport=transport, base_url="http://rl.test", timeout=30,
                                       headers={"content-type": "application/json"})  # as the gateway sends
            runner.run(_seed(client))
            fuzz_app = FuzzApp(runner, client, redis)
            fuzz_app.take_snapshot()
            yield fuzz_app
            runner.run(client.aclose())
        finally:
            runner.run(apps.__aexit__(None, None, None))
    _clean(redis)
    redis.close()


# ------------------------------------------------------------------------------------------------ strategies

HOSTILE_IDS = [
    "", " ", "\t", "t1\n", "a\nb", "*", "rl:v1:*", "{}", "{t1}", "x" * 500, "t" * 65, "c" * 129, "../..", "t1 ",
    "é", "\u202e", "null", "0", "t1/stop", "%2F", "a:b", "t1?x=1", "t1#f", "[]", "\\", "'", '"', "\x7f",
]
ID_POOL = ["t1", "t2", "t3", "t4", "nope", "c1", "c2", "c3", "c4", "u1", "u2", "s1"]

ids = st.one_of(st.sampled_from(ID_POOL), st.sampled_from(HOSTILE_IDS), st.text(max_size=140))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63 - 2, max_value=2**80),
    st.integers(max_value=-(2**63) + 2, min_value=-(2**80)), st.floats(), st.text(max_size=30),
    st.sampled_from(HOSTILE_IDS), st.sampled_from(ID_POOL),
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=12) | st.sampled_from(["reward", "reason", "request", "response",
                                                              "rl_task_id", "capture_id", "reward_mode"]),
                      children, max_size=4),
    max_leaves=20,
)


def dumps(value: Any) -> bytes:
    # The stdlib writes integers of any size and NaN/Infinity, which orjson would refuse.
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def mutated(draw: st.DrawFn, base: Any) -> Any:
    """`base` with 1-3 random edits at random depth: delete, replace (any JSON, hostile id), add a key."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        if not isinstance(doc, (dict, list)) or not doc:
            break
        node: Any = doc
        for _ in range(draw(st.integers(0, 5))):
            values = node.values() if isinstance(node, dict) else node
            inner = [v for v in values if isinstance(v, (dict, list)) and v]
            if not inner:
                break
            node = draw(st.sampled_from(inner))
        slots = sorted(node) if isinstance(node, dict) else list(range(len(node)))
        slot = draw(st.sampled_from(slots))
        op = draw(st.sampled_from(["delete", "replace", "hostile", "add", "wrap"]))
        if op == "delete":
            del node[slot]
        elif op == "replace":
            node[slot] = draw(json_values)
        elif op == "hostile":
            node[slot] = draw(st.sampled_from(HOSTILE_IDS) | st.text(max_size=600))
        elif op == "wrap":
            node[slot] = [node[slot]] if draw(st.booleans()) else {"x": node[slot]}
        elif isinstance(node, dict):
            node[draw(st.text(max_size=12))] = draw(json_values)
        else:
            node.append(draw(json_values))
    return doc


def bodies(*valid: Any) -> st.SearchStrategy[bytes | None]:
    """Valid bodies, mutated ones, arbitrary JSON, raw bytes (non-UTF-8 too), nothing."""
    return st.one_of(
        st.sampled_from(valid).map(dumps),
        st.sampled_from(valid).flatmap(mutated).map(dumps),
        st.sampled_from(valid).flatmap(mutated).map(dumps),
        json_values.map(dumps),
        st.binary(max_size=64),
        st.sampled_from([b"", b"null", b"{", b"[]", b'"x"', b"\xff\xfe", b'{"a": "\xff"}', b"NaN", b"1e999"]),
        st.none(),
    )


def header_values() -> st.SearchStrategy[bytes]:
    # Anything a real HTTP server could deliver: no CR, LF or NUL; obs-text bytes 0x80-0xFF included.
    return st.one_of(
        st.sampled_from(ID_POOL + HOSTILE_IDS).map(lambda s: s.encode()),
        st.binary(max_size=150),
    ).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b"\x00", b""))


@st.composite
def fuzzed_headers(draw: st.DrawFn, names: list[str]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    base = start_headers(draw(st.sampled_from(["s1", "s2", "s5"])), draw(st.sampled_from(["t1", "t5", "t2"])))
    for name in names:
        choice = draw(st.sampled_from(["valid", "absent", "fuzz"]))
        if choice == "valid" and name in base:
            out[name] = base[name].encode()
        elif choice == "fuzz":
            out[name] = draw(header_values())
    return out


def path_id() -> st.SearchStrategy[str]:
    return ids.map(lambda s: quote(s, safe=""))


HOOK_BODIES = {
    "before": [
        {"rl_task_id": "t1", "capture_id": "c9", "request": REQUEST},
        {"rl_task_id": "t1", "capture_id": "c2", "agent_turn_id": None, "request": REQUEST},
        {"rl_task_id": "t4", "capture_id": "c5", "agent_turn_id": "u2", "request": REQUEST},
        {"rl_task_id": "t3", "capture_id": "c6", "request": REQUEST},
    ],
    "after": [
        {"rl_task_id": "t1", "capture_id": "c2", "request": INJECTED, "response": RESPONSE},
        {"rl_task_id": "t1", "capture_id": "c1", "request": INJECTED, "response": RESPONSE},
        {"rl_task_id": "t4", "capture_id": "c4", "agent_turn_id": "u1", "request": INJECTED, "response": RESPONSE},
    ],
    "discard": [
        {"rl_task_id": "t1", "capture_id": "c2"},
        {"rl_task_id": "t1", "capture_id": "c1", "agent_turn_id": "u1"},
        {"rl_task_id": "t4", "capture_id": "c4", "agent_turn_id": "u1"},
    ],
}

RAIL_SAMPLE = {
    "messages": [{"role": "user", "content": "question"}], "prompt_ids": [100, 101, 102],
    "response_tokens": [200, 201], "logprobs": [-0.5, -0.25],
    "response": {"content": "reply", "finish_reason": "stop"}, "tools": [], "step_index": 0,
}
RAIL_BATCHES = [
    {"protocol_version": "rail-v1", "session_id": "rs1", "trajectory_id": "rt1", "samples": [RAIL_SAMPLE]},
    {"protocol_version": "rail-v1", "session_id": "rs1", "trajectory_id": "rt1", "samples": [RAIL_SAMPLE],
     "prev_feedback": {"text": "thanks"}, "session_done": True, "trajectory_meta": {"policy_version": "tiny:v1"}},
]


@st.composite
def cursors(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["text", "b64json", "b64crafted"]))
    if kind == "text":
        return draw(st.text(max_size=80))
    if kind == "b64json":
        raw = dumps(draw(json_values))
    else:
        raw = dumps([
            draw(st.sampled_from(["*", "pending", "trained", None, 0])),
            draw(st.sampled_from(["pending", "training", "trained", "failed", "x"])),
            draw(st.one_of(st.floats(), st.integers(), st.integers(min_value=2**64, max_value=2**200), st.booleans(),
                           st.text(max_size=5))),
            draw(ids),
        ])
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def query_value(*valid: str) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(valid), st.text(max_size=20), st.integers().map(str))


@st.composite
def list_params(draw: st.DrawFn) -> list[tuple[str, str]]:
    params = []
    if draw(st.booleans()):
        params.append(("status", draw(query_value("pending", "training", "trained", "failed", ""))))
    if draw(st.booleans()):
        params.append(("limit", draw(query_value("0", "1", "1000", "1001", "-1", "x", "1.5", "01", ""))))
    if draw(st.booleans()):
        params.append(("cursor", draw(cursors())))
    if draw(st.booleans()):  # repeated or unknown parameters
        params.append((draw(st.sampled_from(["limit", "status", "cursor", "x"])), draw(st.text(max_size=10))))
    return params


def task_routes() -> st.SearchStrategy[Req]:
    return st.one_of(
        st.builds(lambda b, h: Req("POST", "/v1/rl/tasks/start", b, h),
                  bodies({"reward_mode": "terminal"}, {"reward_mode": "delayed_feedback"}),
                  fuzzed_headers(list(start_headers("s", "t")))),
        st.builds(lambda i: Req("GET", f"/v1/rl/tasks/{i}"), path_id()),
        st.builds(lambda i, b: Req("POST", f"/v1/rl/tasks/{i}/stop", b), path_id(), bodies({})),
        st.builds(lambda i, b: Req("POST", f"/v1/rl/tasks/{i}/reward", b), path_id(),
                  bodies({"reward": 0.5}, {"reward": 1}, {"reward": 0})),
    )


def hook_routes() -> st.SearchStrategy[Req]:
    return st.one_of(*(
        st.builds(lambda b, hook=hook: Req("POST", f"/internal/v1/completions:{hook}", b), bodies(*valid))
        for hook, valid in HOOK_BODIES.items()
    ))


def internal_routes() -> st.SearchStrategy[Req]:
    return st.one_of(
        st.builds(lambda i, b: Req("POST", f"/internal/v1/rl/tasks/{i}:finish", b), path_id(),
                  bodies({"reason": "service_stopped"})),
        st.builds(lambda i, b: Req("POST", f"/internal/v1/rl/tasks/{i}:abort", b), path_id(),
                  bodies({"reason": "timeout"}, {"reason": "capture_failed"})),
    )


def read_routes() -> st.SearchStrategy[Req]:
    return st.one_of(
        st.builds(lambda p: Req("GET", "/v1/rl/trajectories", params=p), list_params()),
        st.builds(lambda i: Req("GET", f"/v1/rl/trajectories/{i}"), path_id()),
        st.builds(lambda p: Req("GET", "/v1/rl/trajectories/stats", params=p), list_params()),
        st.just(Req("GET", "/health")),
    )


def rail_routes() -> st.SearchStrategy[Req]:
    return st.builds(lambda b: Req("POST", "/v1/gateway/upload/batch", b), bodies(*RAIL_BATCHES))


def any_route() -> st.SearchStrategy[Req]:
    """Any route, with any method, any headers (session and task ids included) and any body."""
    paths = st.sampled_from([
        "/v1/rl/tasks/start", "/v1/rl/tasks/t1", "/v1/rl/tasks/t1/stop", "/v1/rl/tasks/t2/reward",
        "/internal/v1/completions:before", "/internal/v1/completions:after", "/internal/v1/completions:discard",
        "/internal/v1/rl/tasks/t1:finish", "/internal/v1/rl/tasks/t1:abort", "/v1/rl/trajectories",
        "/v1/rl/trajectories/c3", "/v1/rl/trajectories/stats", "/v1/gateway/upload/batch", "/health",
    ])
    return st.builds(
        Req,
        method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
        path=paths,
        content=bodies({"reward_mode": "terminal"}, {"reward": 0.5}, {"reason": "timeout"}, HOOK_BODIES["before"][0]),
        headers=fuzzed_headers([*start_headers("s", "t"), "Content-Type", "Authorization"]),
    )


# ------------------------------------------------------------------------------------------------ properties


def _run(fuzz: FuzzApp, req: Req) -> None:
    fuzz.restore()
    check(req, fuzz.send(req))


@SETTINGS
@given(req=task_routes())
def test_task_routes(fuzz: FuzzApp, req: Req) -> None:
    _run(fuzz, req)


@SETTINGS
@given(req=hook_routes())
def test_hook_routes(fuzz: FuzzApp, req: Req) -> None:
    _run(fuzz, req)


@SETTINGS
@given(req=internal_routes())
def test_internal_finish_and_abort(fuzz: FuzzApp, req: Req) -> None:
    _run(fuzz, req)


@SETTINGS
@given(req=read_routes())
def test_trajectory_and_health_routes(fuzz: FuzzApp, req: Req) -> None:
    _run(fuzz, req)


@SETTINGS
@given(req=rail_routes())
def test_rail_upload(fuzz: FuzzApp, req: Req) -> None:
    _run(fuzz, req)


@SETTINGS
@given(req=any_route())
def test_any_route_any_method(fuzz: FuzzApp, req: Req) -> None:
    _run(fuzz, req)


# ------------------------------------------------------------------------------------ hostile bodies, every route

POST_ROUTES = [
    "/v1/rl/tasks/start", "/v1/rl/tasks/t1/stop", "/v1/rl/tasks/t2/reward", "/v1/rl/tasks/t1/reward",
    "/internal/v1/completions:before", "/internal/v1/completions:after", "/internal/v1/completions:discard",
    "/internal/v1/rl/tasks/t1:finish", "/internal/v1/rl/tasks/t1:abort", "/v1/gateway/upload/batch",
]


def _nested_lists(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _nested_objects(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


HOSTILE_BODIES = {
    "non-utf8": b"\xff\xfe\xfd\x80",
    "non-utf8 in a string": b'{"reward_mode": "\xff\xfe", "reward": "\xc3\x28", "reason": "\xa0"}',
    "utf-16": '{"reward_mode": "terminal"}'.encode("utf-16"),
    "bom": b'\xef\xbb\xbf{"reward_mode": "terminal"}',
    "lone surrogate escape": b'{"reward_mode": "\\ud800", "rl_task_id": "\\udfff", "reason": "\\ud800"}',
    "10000 nested lists": _nested_lists(10_000),
    "10000 nested objects": _nested_objects(10_000),
    "nested under a key": b'{"reward": ' + _nested_lists(10_000) + b', "reason": ' + _nested_lists(500) + b"}",
    "huge number": b'{"reward": 1' + b"0" * 5000 + b', "reward_mode": -1e999999}',
    "duplicate keys": b'{"reward": 0.5, "reward": 2, "reason": "timeout", "reason": 1}',
}


@pytest.mark.parametrize("route", POST_ROUTES)
@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_hostile_bodies_on_every_post_route(fuzz: FuzzApp, route: str, name: str) -> None:
    req = Req("POST", route, HOSTILE_BODIES[name], start_headers("s5", "t5"))
    _run(fuzz, req)


_HOLE = "@@deep@@"


def _hook_body(hook: str, **request_extra: Any) -> dict[str, Any]:
    body = copy.deepcopy(HOOK_BODIES[hook][0])
    body["request"] = dict(body["request"], **request_extra)
    return body


def _with_deep(body: dict[str, Any], depth: int, leaf: bytes) -> bytes:
    """The body with its `_HOLE` string replaced by `depth` nested lists, built as bytes (an encoder would hit its
    own recursion limit first)."""
    return dumps(body).replace(f'"{_HOLE}"'.encode(), b"[" * depth + leaf + b"]" * depth)


@pytest.mark.parametrize("depth", [100, 200, 260, 400, 900, 1100])
@pytest.mark.parametrize("hook", ["before", "after"])
def test_deeply_nested_values_inside_valid_hook_bodies(fuzz: FuzzApp, hook: str, depth: int) -> None:
    """Nesting that JSON parsers accept but encoders or deep copies may not (orjson writes at most 254 levels)."""
    path = f"/internal/v1/completions:{hook}"
    _run(fuzz, Req("POST", path, _with_deep(_hook_body(hook, metadata=_HOLE), depth, b"1")))
    deep_message = {"role": "user", "content": _HOLE}
    body = _hook_body(hook, messages=[*REQUEST["messages"], deep_message])
    _run(fuzz, Req("POST", path, _with_deep(body, depth, b'"hi"')))
    if hook == "after":  # the open capture c2, its request as reserved, a deep value in the response
        body = copy.deepcopy(HOOK_BODIES["after"][0])
        body["response"] = dict(RESPONSE, system_fingerprint=_HOLE)
        _run(fuzz, Req("POST", path, _with_deep(body, depth, b"1")))


RAIL_HOLES = {
    "message content": lambda b: b["samples"][0]["messages"][0].__setitem__("content", _HOLE),
    "tools": lambda b: b["samples"][0].__setitem__("tools", [_HOLE]),
    "response content": lambda b: b["samples"][0]["response"].__setitem__("content", _HOLE),
    "tool calls": lambda b: b["samples"][0]["response"].__setitem__("tool_calls", [_HOLE]),
    "sample meta": lambda b: b["samples"][0].__setitem__("meta", {"x": _HOLE}),
    "trajectory meta": lambda b: b.__setitem__("trajectory_meta", {"x": _HOLE}),
    "prev_feedback": lambda b: b.__setitem__("prev_feedback", {"text": _HOLE}),
}


@pytest.mark.parametrize("depth", [260, 900])
@pytest.mark.parametrize("where", list(RAIL_HOLES))
def test_deeply_nested_values_inside_a_valid_rail_batch(fuzz: FuzzApp, where: str, depth: int) -> None:
    body = copy.deepcopy(RAIL_BATCHES[1])
    RAIL_HOLES[where](body)
    _run(fuzz, Req("POST", "/v1/gateway/upload/batch", _with_deep(body, depth, b"1")))


@pytest.mark.parametrize("depth", [260, 400])
def test_before_then_after_with_a_deep_request(fuzz: FuzzApp, depth: int) -> None:
    """The gateway's real sequence: `:after` repeats the request `:before` returned."""
    fuzz.restore()
    body = _with_deep({"rl_task_id": "t3", "capture_id": "c7", "request": dict(REQUEST, metadata=_HOLE)}, depth, b"1")
    req = Req("POST", "/internal/v1/completions:before", body)
    check(req, fuzz.send(req))
    after = dict(HOOK_BODIES["after"][0], rl_task_id="t3", capture_id="c7", request=dict(INJECTED, metadata=_HOLE))
    req = Req("POST", "/internal/v1/completions:after", _with_deep(after, depth, b"1"))
    check(req, fuzz.send(req))


@pytest.mark.parametrize("hook", ["before", "after"])
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"max_tokens": 2**64}, id="int beyond 64 bits"),
        pytest.param({"max_tokens": 2**64, "temperature": float("nan")}, id="big int with NaN"),
        pytest.param({"seed": -(2**70), "top_p": float("inf")}, id="negative big int with Infinity"),
        pytest.param({"metadata": {"x": 10**400}}, id="400-digit int"),
    ],
)
def test_out_of_range_numbers_inside_valid_hook_bodies(fuzz: FuzzApp, hook: str, extra: dict[str, Any]) -> None:
    """NaN/Infinity make the body go through the lenient stdlib parser, which keeps integers of any size."""
    _run(fuzz, Req("POST", f"/internal/v1/completions:{hook}", dumps(_hook_body(hook, **extra))))
    if hook == "after":  # the open capture c2 with its reserved request: the numbers sit in the response
        body = dict(HOOK_BODIES["after"][0], response=dict(RESPONSE, **extra))
        _run(fuzz, Req("POST", "/internal/v1/completions:after", dumps(body)))
