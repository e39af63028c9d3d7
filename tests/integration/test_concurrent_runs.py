"""Concurrent Training Runs (issue 36 item 1, docs/training.md "Concurrent runs") and freshness (item 5) with real
Redis, the scripted trainer and a fake gateway on a real socket.

- `max_concurrent_runs: 3`: one tick starts three runs of three lineages, their `backend.train` calls all in flight
  at once; a fourth lineage waits for room (409 for a manual start), a lineage never gets a second run, and a stop
  gives the room to the next line;
- a crash with three runs live (the Redis state frozen at that moment, as a SIGKILL leaves it): the next start
  settles every run and returns each batch to its own line's pending set; the next runs train exactly those batches;
- a `training_run:active` written before runs were concurrent, naming a run of another lineage, is read, guarded and
  recovered like any pointer;
- freshness: the claim records the line's eligible-to-run wait, the activation (or the canary's promotion) the
  samples' sample-to-policy latency, in the record and the histograms.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from tests.integration.test_lineage_scheduler import line, manual_ticks, publish
from tests.support.fake_gateway import FakeGateway
from tests.support.invariants import check_invariants
from tests.support.runs import wait_for_run
from tests.support.service_app import MODEL_ID, make_config

POLICY = {"auto": True, "min_pending_samples": 3, "poll_interval_seconds": 3600.0, "max_concurrent_runs": 3}


@pytest.fixture
async def gateway():
    async with FakeGateway(model_id=MODEL_ID, canary=True) as gw:
        yield gw


@pytest.fixture
def app(redis, redis_url, tmp_path, gateway):
    def factory(policy: dict | None = None, **overrides):
        config = make_config(
            redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted", min_samples_for_training=3,
            max_samples_per_run=3, lora_activation_timeout=3.0, training_tmp_root=str(tmp_path / "train-tmp"),
            training_policy={**POLICY, **(policy or {})}, **overrides)
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        return manual_ticks(config, backend), backend

    return factory


async def violations(redis, policy: dict | None = None) -> list[str]:
    report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False,
                                    training_policy={**POLICY, **(policy or {})})
    # Samples published straight through the store have no Task records; every other rule holds.
    return [v for v in report.violations if "which has no record" not in v]


async def wait_calls(backend, n: int) -> None:
    while len(backend.calls) < n:
        await asyncio.sleep(0.01)


async def pending(redis, lineage: str) -> set[str]:
    return {m.decode() for m in await redis.zrange(keys.traj_index(line(lineage), "pending"), 0, -1)}


async def frozen(redis) -> dict[bytes, bytes]:
    """The service's whole key space as it is now: what a SIGKILL at this moment leaves in Redis."""
    return {key: await redis.dump(key) async for key in redis.scan_iter(match="rl:v1:*")}


async def thaw(redis, dumped: dict[bytes, bytes]) -> None:
    async for key in redis.scan_iter(match="rl:v1:*"):
        await redis.delete(key)
    for key, value in dumped.items():
        await redis.restore(key, 0, value, replace=True)


async def batches_of(deps, names: str, *, ages: tuple[float, ...]) -> dict[str, list[str]]:
    """Register the one-letter lineages `names` and give each 3 pending samples, the i-th lineage's `ages[i]` s old."""
    await deps.redis.zadd(keys.LINEAGES, {name: float(i) for i, name in enumerate(names)})
    return {name: await publish(deps, name, 3, age_s=age) for name, age in zip(names, ages)}


async def test_three_runs_train_at_once_and_the_room_is_machine_wide(app, redis):
    app_cm, backend = app()
    backend.plan = {"outcome": "block"}
    async with app_cm as (application, client):
        deps = application.state.deps
        batches = await batches_of(deps, "abcd", ages=(400, 300, 200, 100))
        started = await deps.scheduler.tick()
        assert sorted(run.lineage for run in started) == ["a", "b", "c"]  # d waited least: no room left
        await wait_calls(backend, 3)  # three `train` calls in flight together, one per lineage
        assert {tuple(call["sample_ids"]) for call in backend.calls} == {tuple(batches[n]) for n in "abc"}
        assert await redis.get(keys.ACTIVE_RUN) is None  # no default-lineage run
        assert set((await redis.hgetall(keys.ACTIVE_LINEAGE_RUNS)).keys()) == {b"a", b"b", b"c"}
        # A manual start of d finds no room; one of a returns a's live run (never a second one).
        full = await client.post("/v1/rl/training/runs", json={"lineage": "d"})
        assert (full.status_code, full.json()["error"]["code"]) == (409, "training_run_conflict")
        same = await client.post("/v1/rl/training/runs", json={"lineage": "a"})
        run_a = next(run for run in started if run.lineage == "a")
        assert (same.status_code, same.json()["training_run_id"]) == (200, run_a.training_run_id)
        view = (await client.get("/v1/rl/lineages/d")).json()["scheduler"]
        assert (view["eligible"], view["eligible_since"] is not None) == (True, True)
        assert await deps.scheduler.tick() == []
        assert await violations(redis) == []
        listed = {i["lineage"]: i["active_run"] for i in (await client.get("/v1/rl/lineages")).json()["items"]}
        assert listed == {n: r.training_run_id for n, r in ((r.lineage, r) for r in started)} | {"d": None}
        # Stopping b gives its room to d at the next tick; b's batch is back on b's line.
        run_b = next(run for run in started if run.lineage == "b")
        stopped = await client.post(f"/v1/rl/training/runs/{run_b.training_run_id}/stop")
        assert stopped.json()["status"] == "canceled"
        assert await pending(redis, "b") == set(batches["b"])
        [run_d] = await deps.scheduler.tick()
        assert run_d.lineage == "d"
        assert run_d.freshness["eligible_wait_seconds"] > 0  # it waited a tick for room
        assert await violations(redis) == []


async def test_a_crash_with_three_runs_live_gives_every_batch_back_to_its_own_line(app, redis):
    app_cm, backend = app()
    backend.plan = {"outcome": "block"}
    async with app_cm as (application, client):
        deps = application.state.deps
        batches = await batches_of(deps, "abc", ages=(100, 100, 100))
        extra = await publish(deps, "a", 2, age_s=50)  # published while a trains: stays pending
        runs = {run.lineage: run for run in await deps.scheduler.tick()}
        assert set(runs) == {"a", "b", "c"}
        await wait_calls(backend, 3)
        crash = await frozen(redis)
    await thaw(redis, crash)
    for name in "abc":
        assert await pending(redis, name) == (set(extra) if name == "a" else set())
    assert await violations(redis) == []  # the frozen state itself holds every invariant

    app_cm, backend = app()
    async with app_cm as (application, client):  # the next leader's start: recovery settles every live run
        deps = application.state.deps
        for name, run in runs.items():
            settled = (await client.get(f"/v1/rl/training/runs/{run.training_run_id}")).json()
            assert (settled["status"], settled["failure_reason"]) == ("failed", "service_restarted")
            assert await pending(redis, name) == set(batches[name]) | (set(extra) if name == "a" else set())
        assert await redis.get(keys.ACTIVE_RUN) is None and await redis.hlen(keys.ACTIVE_LINEAGE_RUNS) == 0
        assert backend.calls == []
        assert await violations(redis) == []
        # The next runs train exactly those batches, each once.
        again = {run.lineage: run for run in await deps.scheduler.tick()}
        for run in again.values():
            await wait_for_run(deps.runner, run.training_run_id)
        trained = {call["training_run_id"]: call["sample_ids"] for call in backend.calls}
        for name in "abc":
            assert trained[again[name].training_run_id] == batches[name]
        assert sorted(s for ids in trained.values() for s in ids) == sorted(s for ids in batches.values() for s in ids)
        assert await violations(redis) == []


async def test_a_pointer_written_before_concurrent_runs_is_guarded_and_recovered(app, redis):
    """Before concurrent runs, `training_run:active` named the one live run, of any lineage. After the upgrade
    such a pointer still names its run: the default lineage cannot claim over it, and the leader's start settles
    the run, its batch back on its own line, the pointer deleted."""
    app_cm, backend = app({"max_concurrent_runs": 2})
    backend.plan = {"outcome": "block"}
    async with app_cm as (application, client):
        deps = application.state.deps
        await redis.zadd(keys.LINEAGES, {"up": 1.0})
        ids = await publish(deps, "up", 3, age_s=100)
        r = await client.post("/v1/rl/training/runs", json={"lineage": "up"})
        run_id = r.json()["training_run_id"]
        await wait_calls(backend, 1)
        # What the previous release wrote for this run: the one pointer, naming a run of `up`.
        async with redis.pipeline(transaction=True) as tx:
            tx.hdel(keys.ACTIVE_LINEAGE_RUNS, "up")
            tx.set(keys.ACTIVE_RUN, run_id)
            await tx.execute()
        assert [run.training_run_id for run in await deps.runner._run_reads.active_runs()] == [run_id]
        await publish(deps, "default", 3, age_s=10)
        refused = await client.post("/v1/rl/training/runs")  # room for 2, but the default slot is held
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, "training_run_conflict")
        assert "written before runs were concurrent" in refused.json()["error"]["message"]
        crash = await frozen(redis)
    await thaw(redis, crash)
    app_cm, backend = app({"max_concurrent_runs": 2})
    async with app_cm as (application, client):
        settled = (await client.get(f"/v1/rl/training/runs/{run_id}")).json()
        assert (settled["status"], settled["failure_reason"]) == ("failed", "service_restarted")
        assert await pending(redis, "up") == set(ids)
        assert await redis.get(keys.ACTIVE_RUN) is None
        assert await violations(redis, {"max_concurrent_runs": 2}) == []
        started = await client.post("/v1/rl/training/runs")  # the default slot is free again
        assert started.status_code == 201, started.text


async def test_freshness_is_recorded_at_claim_and_activation_and_exported(app, redis):
    app_cm, backend = app({"max_concurrent_runs": 1})
    async with app_cm as (application, client):
        deps = application.state.deps
        await redis.zadd(keys.LINEAGES, {"up": 1.0})
        ids = await publish(deps, "up", 3, age_s=120)
        before = time.time()
        [run] = await deps.scheduler.tick()
        done = await wait_for_run(deps.runner, run.training_run_id)
        fresh = (await client.get(f"/v1/rl/training/runs/{run.training_run_id}")).json()["freshness"]
        assert fresh["eligible_wait_seconds"] == pytest.approx(0.0, abs=1.0)  # eligible and started in one tick
        assert (fresh["policy_via"], fresh["sample_to_policy_seconds"]["count"]) == ("activation", 3)
        created = sorted([datetime.fromisoformat(raw.decode()).timestamp()
                          for raw in [await redis.hget(keys.traj(i), "created_at") for i in ids]])
        at = datetime.fromisoformat(fresh["policy_at"]).timestamp()
        assert before <= at <= time.time()
        assert fresh["sample_to_policy_seconds"]["max"] == pytest.approx(at - created[0], abs=1e-3)
        assert fresh["sample_to_policy_seconds"]["p50"] == pytest.approx(at - created[1], abs=1e-3)
        assert done.status == "succeeded"
        metrics = (await client.get("/metrics")).text
        assert f'rl_sample_to_policy_seconds_count{{lineage="other",model_id="{MODEL_ID}"}} 3.0' in metrics
        assert f'rl_training_eligible_wait_seconds_count{{lineage="other",model_id="{MODEL_ID}"}} 1.0' in metrics


async def test_a_canary_promotion_records_the_sample_to_policy_latency(app, redis, gateway):
    app_cm, backend = app({"auto": False}, rollout={"mode": "canary", "share": 0.5, "min_tasks": 1000,
                                                   "max_duration_seconds": 10**9,
                                                   "decision_interval_seconds": 3600.0})
    async with app_cm as (application, client):
        deps = application.state.deps
        await redis.zadd(keys.LINEAGES, {"up": 1.0})
        await publish(deps, "up", 3, age_s=60)
        r = await client.post("/v1/rl/training/runs", json={"lineage": "up"})
        run = await wait_for_run(deps.runner, r.json()["training_run_id"])
        assert run.status == "succeeded"
        assert "policy_at" not in (run.freshness or {})  # a candidate serves a share, it is not the policy yet
        assert (run.freshness or {}).get("eligible_wait_seconds") is None  # manual: its line was never judged
        promoted = await client.post("/v1/rl/rollout/promote", json={"lineage": "up"})
        assert promoted.status_code == 200, promoted.text
        fresh = (await client.get(f"/v1/rl/training/runs/{run.training_run_id}")).json()["freshness"]
        assert (fresh["policy_via"], fresh["sample_to_policy_seconds"]["count"]) == ("promotion", 3)
        assert fresh["sample_to_policy_seconds"]["p95"] >= 60.0
        ttl = await redis.ttl(keys.training_run(run.training_run_id))
        assert ttl > 0  # the terminal record keeps its retention
        stored = orjson.loads(await redis.get(keys.training_run(run.training_run_id)))
        assert stored["freshness"]["policy_via"] == "promotion"
