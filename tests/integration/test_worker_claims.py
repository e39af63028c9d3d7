"""Claims that outlive a request, under several workers (CONTRACT §2.11, §4.3, §4.6): a turn publication and a rail
pop held by a dead worker are taken over; one held by a live worker is left to it.

Two RL Service apps of one worker group run in this process against the test's Redis (each with its own lease
heartbeat); a claim of a dead worker is one whose holder names a process of the group that no longer beats.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.workers.coordinator import Placement
from tests.conftest import load_fixture
from tests.support.fake_judge import FakeJudge, Verdict
from tests.support.invariants import check_invariants
from tests.support.service_app import capture, make_config, running_app, start_task, with_user

REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")
BOOT = "g1"


@pytest.fixture
async def judge():
    async with FakeJudge() as j:
        yield j


@pytest.fixture
async def workers(redis, redis_url, tmp_path, judge):
    """Two workers of one group: (app, client) each; the first one started is the leader."""
    config = make_config(redis_url, tmp_path, judge_endpoint=judge.url, judge_model="judge", judge_retries=0,
                         judge_timeout=5.0, turn_publish_timeout_seconds=2.0)
    async with AsyncExitStack() as stack:
        pairs = [await stack.enter_async_context(running_app(config, placement=Placement(BOOT, slot, 2, 0)))
                 for slot in range(2)]
        assert pairs[0][0].state.deps.coordinator.is_leader
        yield pairs


async def delayed_task_with_turn_one(client) -> None:
    assert (await start_task(client, "s1", "t1", mode="delayed_feedback")).status_code == 201
    _, after = await capture(client, "t1", "c1", REQUEST, RESPONSE, turn="u1")
    assert after.status_code == 204


async def claim_as(redis, holder: str) -> None:
    """Turn u1 of t1 left `publishing` by `holder` (a publisher that stopped half way), its transition set."""
    await redis.set(keys.turn_publish("t1", "u1"), "publishing")
    await redis.set(keys.turn_publisher("t1", "u1"), holder)
    await redis.set(keys.turn_transition("t1"), "u2")


async def test_a_publication_of_a_dead_worker_is_taken_over_by_the_next_before(workers, judge, redis):
    (_, c0), (_, c1) = workers
    await delayed_task_with_turn_one(c0)
    await claim_as(redis, f"{BOOT}:5:424242")  # slot 5 of this group: no heartbeat, dead
    judge.enqueue(Verdict(7))
    _, after = await capture(c1, "t1", "c2", with_user(REQUEST, "better"), RESPONSE, turn="u2")
    assert after is not None and after.status_code == 204
    assert await redis.get(keys.turn_publish("t1", "u1")) == b"published"
    assert not await redis.exists(keys.turn_publisher("t1", "u1"))
    sample = (await c0.get("/v1/rl/trajectories/c1")).json()
    assert sample["judge"]["score"] == 0.7 and sample["judge"]["tag"] == "feedback"
    assert (await check_invariants(redis, model_id="tiny", raise_on_violation=False)).ok


async def test_a_publication_held_by_a_live_worker_is_waited_for_not_taken(workers, judge, redis):
    (app0, c0), (_, c1) = workers
    await delayed_task_with_turn_one(c0)
    live = app0.state.deps.coordinator.member  # worker 0 beats: alive
    await claim_as(redis, live)
    began = time.monotonic()
    before = await c1.post("/internal/v1/completions:before", json={
        "rl_task_id": "t1", "capture_id": "c2", "agent_turn_id": "u2", "request": with_user(REQUEST, "x")})
    assert (before.status_code, before.json()["error"]["code"]) == (409, "completion_conflict")
    assert time.monotonic() - began >= 1.5  # it waited for the live publisher until the deadline (2 s)
    assert judge.requests == []  # never published a second time beside the holder
    task = (await c0.get("/v1/rl/tasks/t1")).json()
    assert (task["status"], task["finish_reason"]) == ("aborted", "capture_failed")
    assert (await check_invariants(redis, model_id="tiny", raise_on_violation=False)).ok


async def test_rail_samples_a_dead_worker_had_in_flight_go_back_live_ones_stay(workers, redis):
    (app0, _), (app1, _) = workers
    rail1 = app1.state.deps.rail
    for session, owner in (("sdead", f"{BOOT}:5:424242"), ("slive", app0.state.deps.coordinator.member)):
        await redis.zadd(keys.rail_inflight(session), {"traj-1:0": 1.0})
        await redis.sadd(keys.RAIL_INFLIGHT_SESSIONS, session)
        await redis.hset(keys.RAIL_INFLIGHT_OWNERS, session, owner)
    assert await rail1.recover() == 1
    assert await redis.zrange(keys.pending_judge_session("sdead"), 0, -1) == [b"traj-1:0"]
    assert not await redis.exists(keys.rail_inflight("sdead"))
    assert await redis.hget(keys.RAIL_INFLIGHT_OWNERS, "sdead") is None
    assert await redis.zrange(keys.rail_inflight("slive"), 0, -1) == [b"traj-1:0"]  # its worker settles it
    assert await redis.smembers(keys.RAIL_INFLIGHT_SESSIONS) == {b"slive"}
