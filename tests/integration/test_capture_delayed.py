"""Delayed-feedback Tasks: turn publication through a real-HTTP fake Judge (CONTRACT §4.3, §6, D8, D9)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.conftest import load_fixture
from tests.support.fake_judge import FakeJudge, Hold, Status, Verdict
from tests.support.service_app import capture, make_config, running_app, start_task, with_user


@pytest.fixture
async def judge():
    async with FakeJudge() as j:
        yield j


@pytest.fixture
async def client(redis, redis_url, tmp_path, judge):
    config = make_config(
        redis_url, tmp_path, judge_endpoint=judge.url, judge_model="judge", judge_retries=0,
        judge_timeout=5.0, turn_publish_timeout_seconds=2.0,
    )
    async with running_app(config) as (_, c):
        yield c


REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")


def code(resp) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


async def status(client, t="t1"):
    body = (await client.get(f"/v1/rl/tasks/{t}")).json()
    return body["status"], body["finish_reason"]


async def stats(client):
    return (await client.get("/v1/rl/trajectories/stats")).json()


async def test_next_turn_publishes_previous_with_feedback(client, judge, redis):
    assert (await start_task(client, "s1", "t1", mode="delayed_feedback")).status_code == 201
    for c in ("c1", "c2"):
        _, after = await capture(client, "t1", c, REQUEST, RESPONSE, turn="u1")
        assert after.status_code == 204
    assert (await stats(client))["total"] == 0
    judge.enqueue(Verdict(6), Verdict(8))
    turn2 = with_user(REQUEST, "that was wrong, try again")
    _, after = await capture(client, "t1", "c3", turn2, RESPONSE, turn="u2")
    assert after.status_code == 204
    assert len(judge.requests) == 2
    assert all("that was wrong, try again" in r.prompt for r in judge.requests)
    assert all("297" not in r.prompt and "logprob" not in r.prompt for r in judge.requests)
    s = await stats(client)
    assert (s["total"], s["by_status"]["pending"]) == (2, 2)
    sample = (await client.get("/v1/rl/trajectories/c1")).json()
    assert sample["judge"]["source"] == "judge" and sample["judge"]["tag"] == "feedback"
    assert sample["judge"]["judge_model"] == "judge" and sample["judge"]["prompt_version"] == "judge-v1"
    scores = sorted(
        [(await client.get(f"/v1/rl/trajectories/{c}")).json()["judge"]["score"] for c in ("c1", "c2")]
    )
    assert scores == [0.6, 0.8]
    published = [e["data"] for e in (await client.get("/v1/rl/tasks/t1/events")).json()["items"]
                 if e["type"] == "turn_published"]
    assert published == [{"agent_turn_id": "u1", "samples": 2, "reward": pytest.approx(0.7)}]  # the turn's mean
    assert await redis.sismember(keys.turns_closed("t1"), "u1")
    assert await redis.get(keys.turn_current("t1")) == b"u2"
    assert not await redis.exists(keys.staged("t1", "c1"))
    # Stop publishes the last turn with "" and tag session_done.
    stopped = await client.post("/v1/rl/tasks/t1/stop")
    assert stopped.json()["status"] == "finalized"
    last = (await client.get("/v1/rl/trajectories/c3")).json()
    assert last["judge"]["tag"] == "session_done"
    assert "(no feedback)" in judge.requests[-1].prompt
    assert await redis.zscore(keys.TASKS_GC, "t1") is not None
    # Terminal rewards are refused for delayed Tasks.
    assert code(await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1})) == (409, "reward_conflict")


async def test_delayed_requires_turn_id(client):
    await start_task(client, "s1", "t1", mode="delayed_feedback")
    before, _ = await capture(client, "t1", "c1", REQUEST, RESPONSE, turn=None)
    assert code(before) == (400, "invalid_completion")
    assert await status(client) == ("active", None)


async def test_late_turn_aborts_and_keeps_published(client, judge, redis):
    await start_task(client, "s1", "t1", mode="delayed_feedback")
    await capture(client, "t1", "c1", REQUEST, RESPONSE, turn="u1")
    await capture(client, "t1", "c2", with_user(REQUEST, "next"), RESPONSE, turn="u2")
    before, _ = await capture(client, "t1", "c3", REQUEST, RESPONSE, turn="u1")
    assert code(before) == (409, "completion_conflict")
    assert await status(client) == ("aborted", "capture_failed")
    assert (await client.get("/v1/rl/trajectories/c1")).status_code == 200  # published turn-1 kept
    assert not await redis.exists(keys.staged("t1", "c2"))  # staged turn-2 dropped
    assert (await stats(client))["total"] == 1


async def test_judge_failure_publishes_nothing_and_aborts(client, judge, redis):
    await start_task(client, "s1", "t1", mode="delayed_feedback")
    await capture(client, "t1", "c1", REQUEST, RESPONSE, turn="u1")
    await capture(client, "t1", "c2", REQUEST, RESPONSE, turn="u1")
    judge.enqueue(Verdict(7), Status(500))
    before, _ = await capture(client, "t1", "c3", with_user(REQUEST, "next"), RESPONSE, turn="u2")
    assert before.status_code == 500
    assert before.json() == {"error": {"code": "internal_error", "message": "internal service error"}}
    assert await status(client) == ("aborted", "capture_failed")
    assert (await stats(client))["total"] == 0
    assert await redis.get(keys.turn_publish("t1", "u1")) == b"failed"


async def test_stop_with_open_capture_conflicts_at_once(client, redis):
    await start_task(client, "s1", "t1", mode="delayed_feedback")
    await capture(client, "t1", "c1", REQUEST, RESPONSE, turn="u1")
    r = await client.post(
        "/internal/v1/completions:before",
        json={"rl_task_id": "t1", "capture_id": "c2", "agent_turn_id": "u1", "request": REQUEST},
    )
    assert r.status_code == 200
    assert code(await client.post("/v1/rl/tasks/t1/stop")) == (409, "task_conflict")
    assert await status(client) == ("active", None)
    assert not await redis.exists(keys.turn_publish("t1", "u1"))


async def test_publication_waits_for_open_capture_then_times_out(client):
    await start_task(client, "s1", "t1", mode="delayed_feedback")
    await capture(client, "t1", "c1", REQUEST, RESPONSE, turn="u1")
    r = await client.post(
        "/internal/v1/completions:before",
        json={"rl_task_id": "t1", "capture_id": "c2", "agent_turn_id": "u1", "request": REQUEST},
    )
    assert r.status_code == 200
    loop = asyncio.get_running_loop()
    started = loop.time()
    before, _ = await capture(client, "t1", "c3", with_user(REQUEST, "next"), RESPONSE, turn="u2")
    waited = loop.time() - started
    assert code(before) == (409, "completion_conflict")
    assert "timed out" in before.json()["error"]["message"]
    assert 1.5 <= waited < 4.0  # turn_publish_timeout_seconds = 2
    assert await status(client) == ("aborted", "capture_failed")


async def test_publication_wakes_when_open_capture_commits(client, judge):
    await start_task(client, "s1", "t1", mode="delayed_feedback")
    await capture(client, "t1", "c1", REQUEST, RESPONSE, turn="u1")
    b2 = await client.post(
        "/internal/v1/completions:before",
        json={"rl_task_id": "t1", "capture_id": "c2", "agent_turn_id": "u1", "request": REQUEST},
    )
    next_turn = asyncio.create_task(capture(client, "t1", "c3", with_user(REQUEST, "next"), RESPONSE, turn="u2"))
    await asyncio.sleep(0.2)
    assert not next_turn.done()  # waiting for c2
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    after2 = await client.post(
        "/internal/v1/completions:after",
        json={"rl_task_id": "t1", "capture_id": "c2", "agent_turn_id": "u1", "request": b2.json()["request"],
              "response": RESPONSE},
    )
    assert after2.status_code == 204
    before, after = await asyncio.wait_for(next_turn, 3)
    assert loop.time() - t0 < 0.9  # woken by the commit, not by the 1 s safety re-check
    assert before.status_code == 200 and after.status_code == 204
    assert (await stats(client))["total"] == 2


async def test_concurrent_first_captures_publish_once(client, judge):
    await start_task(client, "s1", "t1", mode="delayed_feedback")
    for c in ("c1", "c2", "c3"):
        await capture(client, "t1", c, REQUEST, RESPONSE, turn="u1")
    gate = judge.gate()
    judge.enqueue(*(Hold(gate, then=Verdict(5)) for _ in range(3)))
    turn2 = with_user(REQUEST, "next")
    runs = [asyncio.create_task(capture(client, "t1", f"d{i}", turn2, RESPONSE, turn="u2")) for i in range(4)]
    await judge.wait_for_requests_async(3)
    gate.open()
    results = await asyncio.gather(*runs)
    assert all(b.status_code == 200 and a.status_code == 204 for b, a in results)
    assert len(judge.requests) == 3  # one publication: one vote per staged sample
    s = await stats(client)
    assert s["total"] == 3


async def test_another_turn_waiting_is_conflict_without_abort(client, judge):
    await start_task(client, "s1", "t1", mode="delayed_feedback")
    await capture(client, "t1", "c1", REQUEST, RESPONSE, turn="u1")
    gate = judge.gate()
    judge.enqueue(Hold(gate, then=Verdict(5)))
    pending = asyncio.create_task(capture(client, "t1", "c2", with_user(REQUEST, "x"), RESPONSE, turn="u2"))
    await judge.wait_for_requests_async(1)
    r = await client.post(
        "/internal/v1/completions:before",
        json={"rl_task_id": "t1", "capture_id": "c3", "agent_turn_id": "u3", "request": REQUEST},
    )
    assert code(r) == (409, "completion_conflict")
    assert "already waiting" in r.json()["error"]["message"]
    gate.open()
    before, after = await pending
    assert before.status_code == 200 and after.status_code == 204
    assert await status(client) == ("active", None)


async def test_abort_during_publication_rolls_back(client, judge, redis):
    await start_task(client, "s1", "t1", mode="delayed_feedback")
    await capture(client, "t1", "c1", REQUEST, RESPONSE, turn="u1")
    gate = judge.gate()
    judge.enqueue(Hold(gate, then=Verdict(5)))
    pending = asyncio.create_task(capture(client, "t1", "c2", with_user(REQUEST, "x"), RESPONSE, turn="u2"))
    await judge.wait_for_requests_async(1)
    aborted = await client.post("/internal/v1/rl/tasks/t1:abort", json={"reason": "timeout"})
    assert aborted.json()["finish_reason"] == "timeout"
    gate.open()
    before, _ = await pending
    assert code(before) == (409, "completion_conflict")
    assert (await stats(client))["total"] == 0
    assert not await redis.exists(keys.traj("c1"))
    assert await status(client) == ("aborted", "timeout")


async def test_delayed_start_refused_without_judge(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (_, client):
        r = await start_task(client, "s1", "t1", mode="delayed_feedback")
        assert code(r) == (400, "judge_not_configured")
