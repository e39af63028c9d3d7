"""Task and Training Run listings and event timelines over HTTP, against a private real Redis (CONTRACT §2.5, §2.6,
§5.1; issue 9)."""

from __future__ import annotations

import asyncio
import time

import pytest

from openjiuwen.agent_evolving.agent_rl.online.events import MAXLEN
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from tests.conftest import load_fixture
from tests.integration.test_training_runs import publish
from tests.support.fake_gateway import FakeGateway
from tests.support.service_app import MODEL_ID, capture, make_config, running_app, start_task
from tests.support.runs import wait_for_run

REQUEST, RESPONSE = load_fixture("chat_request.json"), load_fixture("chat_response.json")


def code(resp) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


@pytest.fixture
async def app_client(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (app, client):
        yield app, client


async def types(client, path: str) -> list[str]:
    r = await client.get(path)
    assert r.status_code == 200
    items = r.json()["items"]
    assert all(set(item) == {"id", "at", "type", "data"} for item in items)
    return [item["type"] for item in items]


async def test_task_timeline_follows_capture_stop_and_reward(app_client, redis):
    _, client = app_client
    assert (await start_task(client, "s1", "t1")).status_code == 201
    before, after = await capture(client, "t1", "c1", REQUEST, RESPONSE)
    assert after is not None and after.status_code == 204
    await client.post("/internal/v1/completions:before",
                      json={"rl_task_id": "t1", "capture_id": "c2", "request": REQUEST})
    assert (await client.post("/internal/v1/completions:discard", json={"rl_task_id": "t1", "capture_id": "c2"})
            ).status_code == 204
    assert (await client.post("/v1/rl/tasks/t1/stop")).status_code == 200
    assert (await client.post("/v1/rl/tasks/t1/reward", json={"reward": 0.75})).json() == {"sample_count": 1}
    r = await client.get("/v1/rl/tasks/t1/events")
    items = r.json()["items"]
    assert [i["type"] for i in items] == [
        "created", "capture_reserved", "capture_committed", "capture_reserved", "capture_discarded", "finalized",
        "reward_recorded",
    ]
    assert items[0]["data"] == {"agent_session_id": "s1", "reward_mode": "terminal", "policy_lora_name": "base"}
    assert {k: v for k, v in items[2]["data"].items() if k != "sampling"} == {"capture_id": "c1", "agent_turn_id": None}
    assert items[2]["data"]["sampling"]["temperature"] == 1.0  # the effective sampling the sample records (issue 29)
    assert items[5]["data"] == {"reason": "user_stopped"}
    assert items[6]["data"] == {"reward": 0.75, "sample_count": 1}
    assert [i["id"] for i in items] == sorted([i["id"] for i in items], key=lambda x: tuple(map(int, x.split("-"))))
    assert all(i["at"].endswith("+00:00") for i in items)
    # Aborting a Task appends `aborted` with its reason; nothing is appended by a sticky repeat.
    await start_task(client, "s2", "t2")
    for _ in range(2):
        await client.post("/internal/v1/rl/tasks/t2:abort", json={"reason": "timeout"})
    assert await types(client, "/v1/rl/tasks/t2/events") == ["created", "aborted"]
    assert (await client.get("/v1/rl/tasks/t2/events")).json()["items"][1]["data"] == {"reason": "timeout"}


async def test_task_events_unknown_and_bounded(app_client, redis):
    _, client = app_client
    assert code(await client.get("/v1/rl/tasks/nope/events")) == (404, "task_not_found")
    assert code(await client.get("/v1/rl/tasks/bad:id/events")) == (404, "task_not_found")
    await start_task(client, "s1", "t1")
    for i in range(MAXLEN + 300):
        await redis.xadd(keys.task_events("t1"), {"type": "capture_reserved", "at": "x", "data": "{}"},
                         maxlen=MAXLEN, approximate=True)
    n = len((await client.get("/v1/rl/tasks/t1/events")).json()["items"])
    assert MAXLEN <= n < MAXLEN + 300  # `MAXLEN ~`: trimmed, though not to the exact entry


async def test_task_listing_newest_first_by_status_and_paged(app_client, redis):
    _, client = app_client
    for i in range(7):
        assert (await start_task(client, f"s{i}", f"t{i}")).status_code == 201
    await client.post("/v1/rl/tasks/t1/stop")
    await client.post("/v1/rl/tasks/t4/stop")
    await client.post("/internal/v1/rl/tasks/t2:abort", json={"reason": "timeout"})
    body = (await client.get("/v1/rl/tasks")).json()
    assert [t["rl_task_id"] for t in body["items"]] == [f"t{i}" for i in range(6, -1, -1)]
    assert body["next_cursor"] is None
    assert body["items"][2] == (await client.get("/v1/rl/tasks/t4")).json()  # the full Task record
    by_status = {}
    for status in ("active", "finalized", "aborted"):
        r = await client.get("/v1/rl/tasks", params={"status": status})
        by_status[status] = [t["rl_task_id"] for t in r.json()["items"]]
    assert by_status == {"active": ["t6", "t5", "t3", "t0"], "finalized": ["t4", "t1"], "aborted": ["t2"]}
    seen, cursor = [], None
    while True:
        params = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        page = (await client.get("/v1/rl/tasks", params=params)).json()
        assert len(page["items"]) <= 3
        seen += [t["rl_task_id"] for t in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"t{i}" for i in range(6, -1, -1)]
    page = (await client.get("/v1/rl/tasks", params={"status": "active", "limit": 2})).json()
    assert [t["rl_task_id"] for t in page["items"]] == ["t6", "t5"]
    rest = (await client.get("/v1/rl/tasks", params={"status": "active", "cursor": page["next_cursor"]})).json()
    assert ([t["rl_task_id"] for t in rest["items"]], rest["next_cursor"]) == (["t3", "t0"], None)
    # A cursor of another filter, garbage, and out-of-range limits are client mistakes.
    for params in ({"limit": "0"}, {"limit": "1001"}, {"limit": "x"}, {"status": "done"},
                   {"cursor": "garbage!"}, {"status": "finalized", "cursor": page["next_cursor"]}):
        assert code(await client.get("/v1/rl/tasks", params=params)) == (400, "invalid_request"), params


async def test_expired_task_records_leave_the_listing(app_client, redis):
    app, client = app_client
    sweeper = app.state.deps.sweeper
    for i in range(3):
        await start_task(client, f"s{i}", f"t{i}")
    await client.post("/v1/rl/tasks/t0/stop")
    await client.post("/v1/rl/tasks/t1/stop")
    await sweeper.sweep_once()  # terminal Tasks get their TTLs, and a due date in the listing-expiry index
    assert 0 < await redis.ttl(keys.task("t0")) <= 604800
    due = dict(await redis.zrange(keys.TASKS_LISTING_EXPIRY, 0, -1, withscores=True))
    assert set(due) == {b"t0", b"t1"} and all(time.time() + 604000 < v <= time.time() + 604800 for v in due.values())
    await redis.delete(keys.task("t1"))  # as its TTL would
    assert [t["rl_task_id"] for t in (await client.get("/v1/rl/tasks")).json()["items"]] == ["t2", "t0"]
    assert await redis.zscore(keys.TASKS_BY_CREATION, "t1") is None  # dropped lazily by the listing
    assert await redis.zscore(keys.TASKS_LISTING_EXPIRY, "t1") is None
    await redis.delete(keys.task("t0"))
    assert (await sweeper.sweep_once())["listings_removed"] == 0  # not due yet
    assert (await sweeper.sweep_once(now=time.time() + 604801))["listings_removed"] == 1
    assert await redis.zrange(keys.TASKS_BY_CREATION, 0, -1) == [b"t2"]
    assert await redis.zrange(keys.tasks_by_status("finalized"), 0, -1) == []
    assert await redis.zcard(keys.TASKS_LISTING_EXPIRY) == 0


@pytest.fixture
async def training(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID) as gw:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gw.url, trainer_backend="scripted",
                             min_samples_for_training=2, max_samples_per_run=2, lora_activation_timeout=3.0,
                             training_tmp_root=str(tmp_path / "train-tmp"))
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            yield app, client, gw


async def test_run_timeline_listing_and_ttl(training, redis):
    app, client, _ = training
    deps = app.state.deps
    await publish(deps, 4)
    first = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
    await wait_for_run(deps.runner, first)
    second = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
    await wait_for_run(deps.runner, second)
    items = (await client.get(f"/v1/rl/training/runs/{first}/events")).json()["items"]
    kinds = [i["type"] for i in items]
    assert kinds[:2] == ["created", "training_started"]
    assert kinds[-5:] == ["artifact_published", "samples_trained", "activation_attempt", "activation_succeeded",
                          "succeeded"]
    assert set(kinds[2:-5]) <= {"ppo_step"}
    assert items[0]["data"]["sample_count"] == 2 and items[0]["data"]["parent_lora_name"] == "base"
    assert items[-4]["data"] == {"trained": 2, "failed": 0}
    assert 0 < await redis.ttl(keys.training_run_events(first)) <= 2592000
    assert await redis.zcard(keys.RUNS_LISTING_EXPIRY) == 2
    listing = (await client.get("/v1/rl/training/runs")).json()
    assert [r["training_run_id"] for r in listing["items"]] == [second, first]
    assert listing["items"][1] == (await client.get(f"/v1/rl/training/runs/{first}")).json()
    page = (await client.get("/v1/rl/training/runs", params={"limit": 1})).json()
    assert [r["training_run_id"] for r in page["items"]] == [second]
    rest = (await client.get("/v1/rl/training/runs", params={"limit": 1, "cursor": page["next_cursor"]})).json()
    assert ([r["training_run_id"] for r in rest["items"]], rest["next_cursor"]) == ([first], None)
    assert code(await client.get("/v1/rl/training/runs", params={"limit": "0"})) == (400, "invalid_request")
    await redis.delete(keys.training_run(first))  # as its TTL would, 30 days after it ended
    assert (await deps.sweeper.sweep_once(now=time.time() + 2592001))["listings_removed"] == 1
    assert await redis.zrange(keys.RUNS_BY_CREATION, 0, -1) == [second.encode()]
    assert code(await client.get("/v1/rl/training/runs/run-000000000000/events")) == (404, "training_run_not_found")
    assert code(await client.get("/v1/rl/training/runs/bogus/events")) == (404, "training_run_not_found")


async def test_stopped_run_timeline(training, redis):
    app, client, _ = training
    deps = app.state.deps
    deps.backend.plan = {"outcome": "block"}
    await publish(deps, 2)
    run_id = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
    while not deps.backend.calls:  # the execution reaches the backend on its first turn of the loop
        await asyncio.sleep(0.01)
    r = await client.post(f"/v1/rl/training/runs/{run_id}/stop")
    assert r.json()["status"] == "canceled"
    items = (await client.get(f"/v1/rl/training/runs/{run_id}/events")).json()["items"]
    assert [i["type"] for i in items] == ["created", "training_started", "stop_requested", "canceled"]
    assert items[-1]["data"] == {"failure_reason": None, "restored_samples": 2}
