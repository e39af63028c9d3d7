"""Hostile Redis key components are refused at every entry point, and odd but valid ones stay confined to their own
keys (CONTRACT conventions, D12, §9 "hostile session ids"). The RL Service runs as a real process.

Every place a client-chosen id becomes part of a Redis key — the session and task headers of a Task start, the ids
in hook bodies, the ids in URL paths, the rail session and trajectory ids — gets newlines, glob characters, `:`
floods, 10 kB ids, non-ASCII and path tricks. Each must be refused with the route's code (never a 5xx), and
afterwards every key in Redis has one of the contract's shapes (tests/support/invariants.py) and the invariants hold.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from redis.asyncio import Redis

from tests.conftest import load_fixture
from tests.support.fake_judge import FakeJudge
from tests.support.invariants import check_invariants, classify_key
from tests.support.service_app import start_headers
from tests.support.service_process import ServiceProcess

pytestmark = pytest.mark.system

REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")

# Refused everywhere an id is expected. The header-safe ones also go into headers; control characters and edge
# whitespace cannot (the HTTP client refuses them, and uvicorn's parser answers a plain 400 before any app code).
HEADER_SAFE = [
    "", "a b", "*", "rl:v1:*", "?", "[a-z]*", "{t1}", "t1*", "x" * 10_000, ":" * 10_000, "t" * 129,
    "c" * 129, "é", "a/b", "../x", "%2A", "\\", "t1,t2", "a;b",
]
BODY_ONLY = [" ", "\t", "a\x01b", "a\nb", "a\r\nb", "x\x00", "\u2028", "\ud800"]
HOSTILE = HEADER_SAFE + BODY_ONLY
# Valid per the formats, however odd: accepted, and confined to their own keys.
ODD_VALID_TOKENS = [":" * 128, "." * 128, "-", "_:.-", "a" * 128, ":captures", "open:", "x:turn:current"]


@pytest.fixture(scope="module")
def service(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with FakeJudge() as judge, ServiceProcess(
        tmp_path_factory.mktemp("hostile"), redis_url, judge_endpoint=judge.url, judge_model="judge",
        judge_retries=0,
    ) as svc:
        yield svc
        assert "unhandled error" not in svc.log(), svc.log()[-3000:]


@pytest.fixture
def client(service: ServiceProcess, redis: Redis) -> Iterator[httpx.Client]:
    # `redis` (per test) removes every rl:v1: key before and after.
    with httpx.Client(base_url=service.url, timeout=30) as c:
        yield c


def code(r: httpx.Response) -> tuple[int, str]:
    assert 400 <= r.status_code < 500, f"{r.request.method} {r.request.url}: {r.status_code} {r.text[:300]}"
    return r.status_code, r.json()["error"]["code"]


async def assert_keys_clean(redis: Redis) -> None:
    keys = [k.decode() async for k in redis.scan_iter(match="*")]
    assert [k for k in keys if classify_key(k) is None] == []
    assert all(len(k) < 400 and "\n" not in k and "*" not in k for k in keys)
    report = await check_invariants(redis, model_id="tiny")
    assert report.ok, report.describe()


def post_json(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    # The stdlib writes lone surrogates as `\\ud800` escapes, which httpx's own encoder refuses to send.
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def _start(client: httpx.Client, session: str, task: str, mode: str = "terminal") -> httpx.Response:
    headers = {k: v.encode() for k, v in start_headers(session, task).items()}  # UTF-8 bytes, as a client may send
    return client.post("/v1/rl/tasks/start", json={"reward_mode": mode}, headers=headers)  # type: ignore[arg-type]


async def test_hostile_ids_in_task_start_headers(client: httpx.Client, redis: Redis) -> None:
    for bad in HEADER_SAFE:
        assert code(_start(client, bad, "t1")) == (400, "missing_session_id"), repr(bad[:40])
        assert code(_start(client, "s1", bad)) == (400, "invalid_gateway_task"), repr(bad[:40])
    assert set(await redis.keys("*")) <= {b"rl:v1:owner"}  # nothing was written


async def test_hostile_ids_in_hook_bodies(client: httpx.Client, redis: Redis) -> None:
    assert _start(client, "s1", "t1").status_code == 201
    assert _start(client, "s2", "t2", "delayed_feedback").status_code == 201
    for hook in ("before", "after", "discard"):
        for bad in HOSTILE:
            for field, t in (("rl_task_id", bad), ("capture_id", "c1"), ("agent_turn_id", "u1")):
                body = {"rl_task_id": "t2", "capture_id": "c1", "agent_turn_id": "u1", "request": REQUEST,
                        "response": RESPONSE, field: t if field == "rl_task_id" else bad}
                r = post_json(client, f"/internal/v1/completions:{hook}", body)
                assert code(r) == (400, "invalid_completion"), (hook, field, repr(bad[:40]))
    for t in ("t1", "t2"):  # input errors never abort a Task (CONTRACT §2.8)
        assert client.get(f"/v1/rl/tasks/{t}").json()["status"] == "active"
    await assert_keys_clean(redis)


async def test_hostile_ids_in_paths(client: httpx.Client, redis: Redis) -> None:
    assert _start(client, "s1", "t1").status_code == 201
    for bad in HOSTILE:
        if bad == "" or "/" in bad:  # another path altogether: unknown to the router
            p = quote(bad, safe="/")
            for method, path in (("GET", f"/v1/rl/tasks/{p}"), ("POST", f"/v1/rl/tasks/{p}/stop"),
                                 ("GET", f"/v1/rl/trajectories/{p}"), ("GET", f"/v1/rl/training/runs/{p}")):
                assert code(client.request(method, path)) == (404, "request_failed"), path
            continue
        p = quote(bad.encode("utf-8", "surrogatepass"), safe="")
        assert code(client.get(f"/v1/rl/tasks/{p}")) == (404, "task_not_found"), repr(bad[:40])
        assert code(client.post(f"/v1/rl/tasks/{p}/stop")) == (404, "task_not_found")
        assert code(client.post(f"/v1/rl/tasks/{p}/reward", json={"reward": 0.5})) == (404, "task_not_found")
        assert code(client.post(f"/internal/v1/rl/tasks/{p}:finish", json={"reason": "service_stopped"})) == (
            404, "task_conflict")
        assert code(client.post(f"/internal/v1/rl/tasks/{p}:abort", json={"reason": "timeout"})) == (
            404, "task_conflict")
        assert code(client.get(f"/v1/rl/trajectories/{p}")) == (404, "trajectory_not_found")
        assert code(client.get(f"/v1/rl/training/runs/{p}")) == (404, "training_run_not_found")
    assert client.get("/v1/rl/tasks/t1").json()["status"] == "active"
    await assert_keys_clean(redis)


async def test_hostile_ids_in_rail_batches(client: httpx.Client, redis: Redis) -> None:
    sample = {"messages": [{"role": "user", "content": "q"}], "prompt_ids": [1, 2], "response_tokens": [3],
              "logprobs": [-0.5], "response": {"content": "a", "finish_reason": "stop"}, "step_index": 0}
    for bad in HOSTILE:
        for field in ("session_id", "trajectory_id"):
            batch = {"protocol_version": "rail-v1", "session_id": "rs1", "trajectory_id": "rt1",
                     "samples": [sample], "session_done": True, field: bad}
            r = post_json(client, "/v1/gateway/upload/batch", batch)
            # A lone surrogate is not text at all: the generic parse error comes first (CONTRACT §2.1).
            expected = "invalid_request" if bad == "\ud800" else "invalid_rail_batch"
            assert code(r) == (400, expected), (field, repr(bad[:40]))
    await assert_keys_clean(redis)


async def test_odd_but_valid_ids_stay_in_their_own_keys(client: httpx.Client, redis: Redis) -> None:
    """`:` floods and suffix look-alikes (`:captures`, `open:`) are legal ids: each capture, turn and session lands
    in its own keys, the sample round-trips, and no key of another id or another family is touched."""
    for i, token in enumerate(ODD_VALID_TOKENS):
        t = f"t{i}"
        assert _start(client, token, t).status_code == 201, token
        body = {"rl_task_id": t, "capture_id": token, "agent_turn_id": token, "request": REQUEST}
        before = client.post("/internal/v1/completions:before", json=body)
        assert before.status_code == 200, before.text
        after = client.post("/internal/v1/completions:after",
                            json=dict(body, request=before.json()["request"], response=RESPONSE))
        assert after.status_code == 204, after.text
        assert client.post(f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        assert client.post(f"/v1/rl/tasks/{t}/reward", json={"reward": 0.25}).json() == {"sample_count": 1}
        detail = client.get(f"/v1/rl/trajectories/{quote(token, safe='')}")
        assert detail.status_code == 200 and detail.json()["task_id"] == t, detail.text
    stats = client.get("/v1/rl/trajectories/stats").json()
    assert stats["total"] == len(ODD_VALID_TOKENS)
    await assert_keys_clean(redis)
