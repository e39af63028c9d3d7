"""Automatic training (docs/training.md) with real Redis, the scripted trainer and a fake gateway on a real socket.

The scheduler's own loop is kept out of the way (a poll interval of an hour: it ticks once, at take-office, before
any sample exists) and each test calls `scheduler.tick()` itself, so every decision is checked at a known moment;
`test_only_the_leader_schedules` lets the loop run by itself.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from datetime import UTC, datetime

import pytest

from openjiuwen.agent_evolving.agent_rl.online.capture.response import validate_response
from openjiuwen.agent_evolving.agent_rl.online.capture.sample import build_sample
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.tasks.task_records import Task
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from openjiuwen.agent_evolving.agent_rl.online.workers.coordinator import Placement
from tests.integration.test_training_runs import REQUEST, RESPONSE
from tests.support.fake_gateway import FakeGateway
from tests.support.service_app import MODEL_ID, make_config, running_app
from tests.support.runs import wait_for_run

_counter = iter(range(1_000_000))


async def publish(deps, count: int, *, age_s: float = 0.0) -> list[str]:
    """`count` pending samples created `age_s` seconds ago (their wait starts then)."""
    ids = []
    for _ in range(count):
        i = next(_counter)
        task = Task(f"t{i}", f"s{i}", MODEL_ID, "base", "terminal", "finalized", "2026-01-01T00:00:00+00:00")
        validated = validate_response(RESPONSE, policy_model=MODEL_ID)
        sample = build_sample(task, capture_id=f"c{i:05d}", agent_turn_id=None, request=REQUEST,
                              response=RESPONSE, validated=validated)
        sample.meta["created_at"] = datetime.fromtimestamp(time.time() - age_s + i * 1e-6, UTC).isoformat()
        sample.meta["judge"] = {"score": 1.0, "source": "terminal"}
        await deps.samples.publisher.insert_if_absent([sample])
        ids.append(f"c{i:05d}")
    return ids


@pytest.fixture
async def gateway():
    async with FakeGateway(model_id=MODEL_ID, canary=True) as gw:
        yield gw


@pytest.fixture
def service(redis_url, tmp_path, gateway):
    def factory(policy: dict | None = None, **overrides):
        settings = {
            "aigw_endpoint": gateway.url, "trainer_backend": "scripted", "min_samples_for_training": 3,
            "max_samples_per_run": 5, "lora_activation_timeout": 3.0,
            "training_tmp_root": str(tmp_path / "train-tmp"),
            "training_policy": {"auto": True, "min_pending_samples": 3, "poll_interval_seconds": 3600.0,
                                **(policy or {})},
        }
        config = make_config(redis_url, tmp_path, **{**settings, **overrides})
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        return running_app(config, backend=backend), backend

    return factory


async def tick(deps) -> list:
    return await deps.scheduler.tick()


async def test_no_run_below_min_pending_then_one_at_it_with_its_trigger(service, redis):
    app_cm, backend = service()
    async with app_cm as (app, client):
        deps = app.state.deps
        await publish(deps, 2)
        assert await tick(deps) == []
        assert not await redis.exists(keys.ACTIVE_RUN) and backend.calls == []
        await publish(deps, 1)
        [run] = await tick(deps)
        done = await wait_for_run(deps.runner, run.training_run_id)
        assert (done.status, done.sample_count, done.lora_name) == ("succeeded", 3, f"{MODEL_ID}:v1")
        public = (await client.get(f"/v1/rl/training/runs/{run.training_run_id}")).json()
        assert public["trigger"] == {"kind": "auto", "reason": "min_pending_samples", "lineage": "default",
                                     "pending_samples": 3, "eligible_samples": 3,
                                     "oldest_wait_seconds": public["trigger"]["oldest_wait_seconds"]}
        events = (await client.get(f"/v1/rl/training/runs/{run.training_run_id}/events")).json()["items"]
        created = next(e for e in events if e["type"] == "created")
        assert created["data"]["trigger"]["kind"] == "auto"
        metrics = (await client.get("/metrics")).text
        assert f'rl_training_runs_started_total{{model_id="{MODEL_ID}",trigger="auto"}} 1.0' in metrics


async def test_max_wait_trains_a_smaller_batch_above_the_floor_and_not_below(service):
    app_cm, backend = service({"min_pending_samples": 5, "max_wait_seconds": 60, "min_batch_on_wait": 2})
    async with app_cm as (app, client):
        deps = app.state.deps
        await publish(deps, 1, age_s=120)  # waited long enough, but below the floor
        assert await tick(deps) == []
        view = (await client.get("/v1/rl/lineages/default")).json()["scheduler"]
        assert (view["eligible"], view["reason"], view["pending_samples"]) == (False, "below_floor", 1)
        assert view["oldest_wait_seconds"] >= 120
        await publish(deps, 1)  # two now: at the floor, the oldest past max_wait
        [run] = await tick(deps)
        assert (run.sample_count, run.trigger["reason"], run.trigger["eligible_samples"]) == (
            2, "max_wait_seconds", 2)
        await wait_for_run(deps.runner, run.training_run_id)
        await publish(deps, 2)  # fresh ones: at the floor but not waited long enough
        assert await tick(deps) == []
        view = (await client.get("/v1/rl/lineages/default")).json()["scheduler"]
        assert (view["reason"], view["next_eligible_at"] is not None) == ("waiting", True)


async def test_min_interval_counts_from_the_previous_run_end(service, redis):
    app_cm, _ = service({"min_interval_seconds": 3600})
    async with app_cm as (app, client):
        deps = app.state.deps
        await publish(deps, 3)
        [first] = await tick(deps)  # never trained before: no interval to wait
        await wait_for_run(deps.runner, first.training_run_id)
        await publish(deps, 3)
        assert await tick(deps) == []
        view = (await client.get("/v1/rl/lineages/default")).json()["scheduler"]
        assert (view["reason"], view["last_run_ended_at"] is not None) == ("min_interval", True)
        # The previous run ended an hour ago (what the terminal EXEC wrote, moved back): eligible again.
        await redis.hset(keys.TRAINING_LAST_END, MODEL_ID, time.time() - 3601)
        [second] = await tick(deps)
        assert second.training_run_id != first.training_run_id


async def test_an_active_run_blocks_the_next_one_max_concurrent_runs(service, redis):
    app_cm, backend = service()
    backend.plan = {"outcome": "block"}
    async with app_cm as (app, client):
        deps = app.state.deps
        await publish(deps, 3)
        [run] = await tick(deps)
        await publish(deps, 10)
        assert await tick(deps) == []  # 10 eligible, but the one machine-wide slot is taken
        view = (await client.get("/v1/rl/lineages/default")).json()["scheduler"]
        assert (view["reason"], view["active_run"]) == ("run_active", run.training_run_id)
        await client.post(f"/v1/rl/training/runs/{run.training_run_id}/stop")


async def test_pause_stops_auto_runs_survives_a_restart_and_resume_restarts_them(service, redis):
    app_cm, _ = service()
    async with app_cm as (app, client):
        paused = await client.post("/v1/rl/lineages/default/pause")
        assert paused.status_code == 200 and paused.json()["paused"] is True
        await publish(app.state.deps, 3)
        assert await tick(app.state.deps) == []
    app_cm, _ = service()
    async with app_cm as (app, client):  # a new process: the pause is in Redis
        deps = app.state.deps
        view = (await client.get("/v1/rl/lineages/default")).json()
        assert (view["paused"], view["scheduler"]["reason"]) == (True, "paused")
        assert await tick(deps) == []
        resumed = (await client.post("/v1/rl/lineages/default/resume")).json()
        assert resumed["paused"] is False and resumed["scheduler"]["eligible"] is True
        [run] = await tick(deps)
        await wait_for_run(deps.runner, run.training_run_id)


async def test_lineage_routes_refuse_unknown_lineages_and_bodies(service):
    app_cm, _ = service()
    async with app_cm as (_, client):
        for method, path in (("GET", "/v1/rl/lineages/support"), ("POST", "/v1/rl/lineages/support/pause"),
                             ("POST", "/v1/rl/lineages/Bad%20name/resume")):
            r = await client.request(method, path)
            assert (r.status_code, r.json()["error"]["code"]) == (404, "lineage_not_found")
        r = await client.post("/v1/rl/lineages/default/pause", json={"x": 1})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_lineage_request")


async def test_manual_runs_still_work_while_auto_is_on(service, redis):
    app_cm, _ = service({"min_pending_samples": 10})
    async with app_cm as (app, client):
        deps = app.state.deps
        await publish(deps, 3)
        assert await tick(deps) == []
        r = await client.post("/v1/rl/training/runs")
        assert r.status_code == 201 and r.json()["trigger"] == {"kind": "manual"}
        await wait_for_run(deps.runner, r.json()["training_run_id"])
        metrics = (await client.get("/metrics")).text
        assert f'rl_training_runs_started_total{{model_id="{MODEL_ID}",trigger="manual"}} 1.0' in metrics


async def test_a_deciding_canary_holds_the_next_auto_run(service, gateway):
    app_cm, _ = service(rollout={"mode": "canary", "decision_interval_seconds": 3600.0})
    async with app_cm as (app, client):
        deps = app.state.deps
        await publish(deps, 3)
        [run] = await tick(deps)
        done = await wait_for_run(deps.runner, run.training_run_id)
        assert done.status == "succeeded" and gateway.candidate is not None  # the canary of the auto run
        await publish(deps, 3)
        assert await tick(deps) == []
        view = (await client.get("/v1/rl/lineages/default")).json()["scheduler"]
        assert view["reason"] == "rollout_deciding"
        assert (await client.post("/v1/rl/rollout/promote")).status_code == 200
        [second] = await tick(deps)
        assert second.parent_lora_name == f"{MODEL_ID}:v1"


async def test_only_the_leader_schedules(redis, redis_url, tmp_path, gateway):
    """Two workers with the loop running on its own (every 50 ms): one run, started by the leader."""
    config = make_config(
        redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted", min_samples_for_training=3,
        max_samples_per_run=3, lora_activation_timeout=3.0, training_tmp_root=str(tmp_path / "train-tmp"),
        training_policy={"auto": True, "min_pending_samples": 3, "poll_interval_seconds": 0.05})
    backends = [ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID)) for _ in range(2)]
    for backend in backends:
        backend.plan = {"outcome": "block"}  # the run stays active: a second start would have to be a new run
    async with AsyncExitStack() as stack:
        apps = [(await stack.enter_async_context(
            running_app(config, backend=backends[slot], placement=Placement("g1", slot, 2, 0))))[0]
            for slot in range(2)]
        leader, follower = (a.state.deps for a in apps)
        assert leader.coordinator.is_leader and not follower.coordinator.is_leader
        await publish(leader, 6)
        deadline = time.monotonic() + 20
        while not await redis.exists(keys.ACTIVE_RUN):
            assert time.monotonic() < deadline, "no automatic run started"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # ten more ticks of the leader
        assert await redis.zcard(keys.RUNS_BY_CREATION) == 1
        assert len(backends[0].calls) == 1 and backends[1].calls == []
        assert follower.scheduler._task is None
        run_id = (await redis.get(keys.ACTIVE_RUN)).decode()
        await leader.runner.stop(run_id)
