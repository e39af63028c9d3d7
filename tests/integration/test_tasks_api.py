"""Task start/get/stop/finish/abort over the HTTP contract, against a private real Redis (CONTRACT §2.4, §2.5, §2.9)."""

from __future__ import annotations

import asyncio

import pytest

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.conftest import load_fixture
from tests.support.service_app import make_config, running_app, start_headers, start_task


@pytest.fixture
async def app_client(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (app, client):
        yield client


def error_code(resp) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


async def test_start_creates_then_reuses(app_client, redis):
    r = await start_task(app_client, "s1", "t1")
    assert r.status_code == 201
    body = r.json()
    assert body == {
        "rl_task_id": "t1", "agent_session_id": "s1", "model_id": "tiny", "policy_lora_name": "base",
        "reward_mode": "terminal", "status": "active", "created_at": body["created_at"], "finished_at": None,
        "finish_reason": None, "policy_model": "tiny", "evaluation": False, "agent_key_id": None,
    }
    assert (await start_task(app_client, "s1", "t1")).json() == body  # identical repeat → 200 same record
    assert (await start_task(app_client, "s1", "t1")).status_code == 200
    busy = await start_task(app_client, "s1", "t2")  # busy session, another id → the active Task
    assert (busy.status_code, busy.json()["rl_task_id"]) == (200, "t1")
    assert await redis.get(keys.active_session("s1")) == b"t1"
    assert await redis.smembers(keys.ACTIVE_TASKS) == {b"t1"}
    assert not await redis.exists(keys.task("t2"))


async def test_start_conflict_on_different_spec(app_client):
    assert (await start_task(app_client, "s1", "t1")).status_code == 201
    r = await start_task(app_client, "s2", "t1")
    assert error_code(r) == (409, "task_conflict")


@pytest.mark.parametrize(
    ("headers", "body", "code"),
    [
        ({"X-Agent-Session-Id": ""}, {"reward_mode": "terminal"}, "missing_session_id"),
        ({"X-Agent-Session-Id": "a b"}, {"reward_mode": "terminal"}, "missing_session_id"),
        ({"X-Agent-Session-Id": "a/b"}, {"reward_mode": "terminal"}, "missing_session_id"),
        ({"X-Agent-Session-Id": "x" * 129}, {"reward_mode": "terminal"}, "missing_session_id"),
        ({"X-Agent-Session-Id": "rl:v1:*"}, {"reward_mode": "terminal"}, "missing_session_id"),
        ({}, {"reward_mode": "terminal", "x": 1}, "invalid_task_request"),
        ({}, {}, "invalid_task_request"),
        ({}, {"reward_mode": "online"}, "invalid_reward_mode"),
        ({}, {"reward_mode": 1}, "invalid_reward_mode"),
        ({}, {"reward_mode": "delayed_feedback"}, "judge_not_configured"),
        ({"X-AIGW-RL-Task-Id": " "}, {"reward_mode": "terminal"}, "invalid_gateway_task"),
        ({"X-AIGW-RL-Policy-Name": ""}, {"reward_mode": "terminal"}, "invalid_gateway_task"),
        ({"X-AIGW-RL-Policy-Model": ""}, {"reward_mode": "terminal"}, "invalid_gateway_task"),
        ({"X-AIGW-RL-Task-Id": "task:invalid"}, {"reward_mode": "terminal"}, "invalid_gateway_task"),
        ({"X-AIGW-RL-Task-Id": "t" * 65}, {"reward_mode": "terminal"}, "invalid_gateway_task"),
    ],
)
async def test_start_rejections(app_client, redis, headers, body, code):
    h = start_headers("s1", "t1")
    h.update(headers)
    h = {k: v for k, v in h.items() if v != "" or k == "X-Agent-Session-Id"}
    r = await app_client.post("/v1/rl/tasks/start", json=body, headers=h)
    assert error_code(r) == (400, code)
    assert await redis.smembers(keys.ACTIVE_TASKS) == set()


async def test_missing_session_header_and_bad_bodies(app_client):
    h = start_headers("s1", "t1")
    del h["X-Agent-Session-Id"]
    assert error_code(await app_client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"}, headers=h)) == (
        400, "missing_session_id",
    )
    h = start_headers("s1", "t1")
    assert error_code(await app_client.post("/v1/rl/tasks/start", content=b"{not json", headers=h)) == (
        400, "invalid_request",
    )
    assert error_code(await app_client.post("/v1/rl/tasks/start", json=[1], headers=h)) == (400, "invalid_request")


async def test_concurrent_starts_from_two_instances_converge(redis, redis_url, tmp_path):
    config = make_config(redis_url, tmp_path)
    async with running_app(config) as (_, a), running_app(config) as (_, b):
        clients = [a, b] * 4
        results = await asyncio.gather(
            *(start_task(c, "shared", f"t{i}") for i, c in enumerate(clients))
        )
        ids = {r.json()["rl_task_id"] for r in results}
        assert len(ids) == 1
        assert sorted(r.status_code for r in results) == [200] * 7 + [201]
        (winner,) = ids
        assert await redis.smembers(keys.ACTIVE_TASKS) == {winner.encode()}
        losers = [f"t{i}" for i in range(8) if f"t{i}" != winner]
        assert not any([await redis.exists(keys.task(t)) for t in losers])


AGENT = "X-AIGW-RL-Agent-Key"


async def test_a_task_started_with_an_agent_key_answers_only_to_that_key(app_client, redis):
    """Issue 28 item 3: the gateway names the agent key behind a start, stop or reward (ext header); a Task started
    with one agent key is unknown to another, while the operator (no header, as an AIGW sends) reaches every Task."""
    a_start = {**start_headers("s-a", "ta"), AGENT: "agent-a"}
    r = await app_client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"}, headers=a_start)
    assert r.status_code == 201 and r.json()["agent_key_id"] == "agent-a"
    events = (await app_client.get("/v1/rl/tasks/ta/events")).json()["items"]
    assert events[0]["data"]["agent_key_id"] == "agent-a"
    # Another agent key: the Task does not exist for it, and nothing changes.
    b = {AGENT: "agent-b"}
    assert error_code(await app_client.post("/v1/rl/tasks/ta/stop", headers=b)) == (404, "task_not_found")
    r = await app_client.post("/v1/rl/tasks/ta/reward", json={"reward": 1}, headers=b)
    assert error_code(r) == (404, "task_not_found")
    # It can neither start a second Task on the session nor be handed the first one.
    r = await app_client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                              headers={**start_headers("s-a", "tb"), **b})
    assert error_code(r) == (409, "task_conflict") and "rl_task_id" not in r.text
    assert not await redis.exists(keys.task("tb"))
    # A malformed caller is nobody's Task owner; a malformed owner is refused at start.
    assert error_code(await app_client.post("/v1/rl/tasks/ta/stop", headers={AGENT: ""})) == (404, "task_not_found")
    r = await app_client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                              headers={**start_headers("s-x", "tx"), AGENT: "bad key"})
    assert error_code(r) == (400, "invalid_gateway_task")
    assert (await app_client.get("/v1/rl/tasks/ta")).json()["status"] == "active"
    # The owner and the operator reach it: a repeated start answers it, the owner's reward passes the ownership
    # check (and meets the reward rules: no capture yet), the owner stops it.
    r = await app_client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                              headers={**start_headers("s-a", "tc"), AGENT: "agent-a"})
    assert (r.status_code, r.json()["rl_task_id"]) == (200, "ta")
    assert ((await start_task(app_client, "s-a", "td")).json()["rl_task_id"]) == "ta"  # the operator
    r = await app_client.post("/v1/rl/tasks/ta/reward", json={"reward": 1}, headers={AGENT: "agent-a"})
    assert error_code(r) == (409, "reward_conflict")
    r = await app_client.post("/v1/rl/tasks/ta/stop", headers={AGENT: "agent-a"})
    assert (r.status_code, r.json()["status"]) == (200, "finalized")
    r = await app_client.post("/v1/rl/tasks/ta/reward", json={"reward": 1}, headers=b)
    assert error_code(r) == (404, "task_not_found")  # still unknown to the other key once finalized
    # An operator's Task is unknown to every agent key.
    assert (await start_task(app_client, "s-op", "top")).status_code == 201
    assert error_code(await app_client.post("/v1/rl/tasks/top/stop", headers=b)) == (404, "task_not_found")
    assert (await app_client.post("/v1/rl/tasks/top/stop")).json()["status"] == "finalized"


async def test_get_and_unknown(app_client):
    await start_task(app_client, "s1", "t1")
    assert (await app_client.get("/v1/rl/tasks/t1")).json()["status"] == "active"
    assert error_code(await app_client.get("/v1/rl/tasks/nope")) == (404, "task_not_found")
    assert error_code(await app_client.get("/v1/rl/tasks/bad:id")) == (404, "task_not_found")
    assert error_code(await app_client.post("/v1/rl/tasks/nope/stop")) == (404, "task_not_found")
    assert error_code(await app_client.post("/v1/rl/tasks/nope/reward", json={"reward": 1})) == (404, "task_not_found")
    for hook in ("before", "after", "discard"):
        body = {"rl_task_id": "nope", "capture_id": "c1", "request": {}, "response": {}}
        r = await app_client.post(f"/internal/v1/completions:{hook}", json=body)
        assert error_code(r) == (404, "completion_conflict")
    r = await app_client.post("/internal/v1/rl/tasks/nope:finish", json={"reason": "service_stopped"})
    assert error_code(r) == (404, "task_conflict")
    r = await app_client.post("/internal/v1/rl/tasks/nope:abort", json={"reason": "timeout"})
    assert error_code(r) == (404, "task_conflict")


async def test_stop_is_sticky_and_session_restarts(app_client, redis):
    await start_task(app_client, "s1", "t1")
    stopped = await app_client.post("/v1/rl/tasks/t1/stop", json={"ignored": True})
    assert (stopped.status_code, stopped.json()["status"], stopped.json()["finish_reason"]) == (
        200, "finalized", "user_stopped",
    )
    assert (await app_client.post("/v1/rl/tasks/t1/stop")).json() == stopped.json()
    # Abort of a finalized Task returns it unchanged.
    aborted = await app_client.post("/internal/v1/rl/tasks/t1:abort", json={"reason": "timeout"})
    assert aborted.json() == stopped.json()
    assert not await redis.exists(keys.active_session("s1"))
    assert await redis.zscore(keys.TASKS_GC, "t1") is not None  # no capture: nothing awaits a reward
    assert (await start_task(app_client, "s1", "t2")).status_code == 201


async def test_finish_and_abort_bodies(app_client):
    await start_task(app_client, "s1", "t1")
    for body in ({}, {"reason": "user_stopped"}, {"reason": "service_stopped", "x": 1}):
        r = await app_client.post("/internal/v1/rl/tasks/t1:finish", json=body)
        assert error_code(r) == (400, "invalid_finish_reason")
    for body in ({}, {"reason": "service_stopped"}, {"reason": None}):
        r = await app_client.post("/internal/v1/rl/tasks/t1:abort", json=body)
        assert error_code(r) == (400, "invalid_abort_reason")
    r = await app_client.post("/internal/v1/rl/tasks/t1:finish", json={"reason": "service_stopped"})
    assert (r.json()["status"], r.json()["finish_reason"]) == ("finalized", "service_stopped")


async def test_abort_removes_open_capture_state(app_client, redis):
    await start_task(app_client, "s1", "t1")
    request = load_fixture("chat_request.json")
    r = await app_client.post(
        "/internal/v1/completions:before", json={"rl_task_id": "t1", "capture_id": "c1", "request": request}
    )
    assert r.status_code == 200
    assert await redis.exists(keys.capture("t1", "c1"))
    # Stop with an open capture is a conflict at once, and the Task stays active.
    assert error_code(await app_client.post("/v1/rl/tasks/t1/stop")) == (409, "task_conflict")
    assert error_code(
        await app_client.post("/internal/v1/rl/tasks/t1:finish", json={"reason": "service_stopped"})
    ) == (409, "task_conflict")
    assert (await app_client.get("/v1/rl/tasks/t1")).json()["status"] == "active"
    r = await app_client.post("/internal/v1/rl/tasks/t1:abort", json={"reason": "capture_failed"})
    assert (r.json()["status"], r.json()["finish_reason"]) == ("aborted", "capture_failed")
    assert not await redis.exists(keys.capture("t1", "c1"))
    assert not await redis.exists(keys.open_captures("t1"))
    assert await redis.smembers(keys.captures("t1")) == set()
    assert await redis.smembers(keys.ACTIVE_TASKS) == set()
    assert not await redis.exists(keys.active_session("s1"))
    # Sticky: a second abort or a finish returns the stored record.
    again = await app_client.post("/internal/v1/rl/tasks/t1:finish", json={"reason": "service_stopped"})
    assert again.json() == r.json()
