"""Retention sweeper (CONTRACT §5.5, D13): TTLs on terminal Tasks, expiry of unrewarded samples, pending never."""

from __future__ import annotations

import time

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.conftest import load_fixture
from tests.support.service_app import capture, make_config, running_app, start_task

REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    config = make_config(redis_url, tmp_path, task_retention_seconds=3600, reward_timeout_seconds=60)
    async with running_app(config) as (app, client):
        yield app.state.deps, client


async def test_terminal_tasks_get_ttls_active_never(service, redis):
    deps, client = service
    await start_task(client, "s1", "t1")
    await capture(client, "t1", "c1", REQUEST, RESPONSE)
    await client.post("/v1/rl/tasks/t1/stop")
    await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1.0})
    await start_task(client, "s2", "t2")
    await capture(client, "t2", "c2", REQUEST, RESPONSE)
    result = await deps.sweeper.sweep_once()
    assert result["tasks_ttl"] == 1
    for key in (keys.task("t1"), keys.capture("t1", "c1"), keys.captures("t1"), keys.committed_captures("t1"),
                keys.reward("t1")):
        assert 0 < await redis.ttl(key) <= 3600, key
    assert await redis.zcard(keys.TASKS_GC) == 0
    # The active Task, its staged sample and the published pending sample never expire (Invariant 8).
    for key in (keys.task("t2"), keys.capture("t2", "c2"), keys.staged("t2", "c2"), keys.traj("c1")):
        assert await redis.ttl(key) == -1, key


async def test_unrewarded_samples_expire_and_are_counted(service, redis):
    deps, client = service
    await start_task(client, "s1", "t1")
    await capture(client, "t1", "c1", REQUEST, RESPONSE)
    await capture(client, "t1", "c2", REQUEST, RESPONSE)
    await client.post("/v1/rl/tasks/t1/stop")
    # Within the window nothing happens.
    assert (await deps.sweeper.sweep_once())["reward_expired"] == 0
    assert await redis.exists(keys.staged("t1", "c1"))
    result = await deps.sweeper.sweep_once(now=time.time() + 61)
    assert result["reward_expired"] == 2
    assert not await redis.exists(keys.staged("t1", "c1"), keys.staged("t1", "c2"))
    assert orjson.loads(await redis.get(keys.reward("t1")))["status"] == "expired"
    assert (await client.get("/v1/rl/trajectories/stats")).json()["expired_unrewarded"] == 2
    r = await client.post("/v1/rl/tasks/t1/reward", json={"reward": 0.5})
    assert (r.status_code, r.json()["error"]["code"]) == (409, "reward_conflict")
    # A second sweep does not count twice; the Task went to gc and gets its TTLs.
    assert (await deps.sweeper.sweep_once(now=time.time() + 61))["reward_expired"] == 0
    assert (await client.get("/v1/rl/trajectories/stats")).json()["expired_unrewarded"] == 2
    assert await redis.ttl(keys.task("t1")) > 0


async def test_sweeper_completes_an_interrupted_projection(service, redis):
    deps, client = service
    await start_task(client, "s1", "t1")
    await capture(client, "t1", "c1", REQUEST, RESPONSE)
    await client.post("/v1/rl/tasks/t1/stop")
    # A crash right after the claim left `projecting` with nothing inserted yet.
    await redis.set(keys.reward("t1"), orjson.dumps({"reward": 0.4, "status": "projecting", "sample_count": 0}))
    await deps.sweeper.sweep_once(now=time.time() + 61)
    state = orjson.loads(await redis.get(keys.reward("t1")))
    assert (state["status"], state["sample_count"]) == ("published", 1)
    sample = (await client.get("/v1/rl/trajectories/c1")).json()
    assert sample["judge"] == {"score": 0.4, "source": "terminal"}
    assert not await redis.exists(keys.staged("t1", "c1"))


async def test_same_reward_repairs_an_interrupted_projection(service, redis):
    deps, client = service
    await start_task(client, "s1", "t1")
    await capture(client, "t1", "c1", REQUEST, RESPONSE)
    await client.post("/v1/rl/tasks/t1/stop")
    await redis.set(keys.reward("t1"), orjson.dumps({"reward": 0.4, "status": "projecting", "sample_count": 0}))
    r = await client.post("/v1/rl/tasks/t1/reward", json={"reward": 0.5})
    assert r.status_code == 409
    assert (await client.post("/v1/rl/tasks/t1/reward", json={"reward": 0.4})).json() == {"sample_count": 1}
    assert (await client.get("/v1/rl/trajectories/stats")).json()["total"] == 1
