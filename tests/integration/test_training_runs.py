"""Training Runs with the scripted backend and a fake gateway on a real socket (CONTRACT §2.6, §3.8, §4.7, §4.8)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.capture.response import validate_response
from openjiuwen.agent_evolving.agent_rl.online.capture.sample import build_sample
from openjiuwen.agent_evolving.agent_rl.online.capture.request import normalize_request
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.tasks.task_records import Task
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from tests.conftest import load_fixture
from tests.support.fake_gateway import Fail, FakeGateway, Hang
from tests.support.invariants import check_invariants
from tests.support.service_app import MODEL_ID, make_config, running_app
from tests.support.runs import wait_for_run

REQUEST = normalize_request(load_fixture("chat_request.json"))
RESPONSE = load_fixture("chat_response.json")


def code(resp) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


async def publish(deps, count: int, *, policy: str = "base", start: int = 0, score: float = 1.0) -> list[str]:
    """Publish `count` pending samples through the store, oldest first (distinct created_at)."""
    ids = []
    for i in range(start, start + count):
        task = Task(f"t{i}", f"s{i}", MODEL_ID, policy, "terminal", "finalized", "2026-01-01T00:00:00+00:00")
        validated = validate_response(RESPONSE, policy_model=MODEL_ID)
        sample = build_sample(task, capture_id=f"c{i:04d}", agent_turn_id=None, request=REQUEST,
                              response=RESPONSE, validated=validated)
        sample.meta["created_at"] = f"2026-01-01T00:00:{i % 60:02d}.{i:06d}+00:00"
        sample.meta["judge"] = {"score": score, "source": "terminal"}
        await deps.samples.publisher.insert_if_absent([sample])
        ids.append(f"c{i:04d}")
    return ids


@pytest.fixture
async def gateway():
    async with FakeGateway(model_id=MODEL_ID) as gw:
        yield gw


@pytest.fixture
def make_service(redis, redis_url, tmp_path, gateway):
    def factory(**overrides):
        settings = {
            "aigw_endpoint": gateway.url, "trainer_backend": "scripted", "min_samples_for_training": 3,
            "max_samples_per_run": 3, "lora_activation_timeout": 3.0,
            "training_tmp_root": str(tmp_path / "train-tmp"),
        }
        config = make_config(redis_url, tmp_path, **{**settings, **overrides})
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        return running_app(config, backend=backend), backend

    return factory


async def statuses(redis, ids):
    return [(await redis.hget(keys.traj(i), "status")).decode() for i in ids]


async def test_insufficient_samples_creates_nothing(make_service, redis):
    app_cm, _ = make_service()
    async with app_cm as (app, client):
        await publish(app.state.deps, 2)
        r = await client.post("/v1/rl/training/runs")
        assert code(r) == (409, "insufficient_samples")
        assert r.json()["error"]["message"] == "pending samples 2 is below minimum 3"
        assert not await redis.exists(keys.ACTIVE_RUN)
        assert [k async for k in redis.scan_iter("rl:v1:training_run:*")] == []


async def test_gateway_unavailable_is_502_without_run(make_service, gateway, redis):
    app_cm, backend = make_service()
    async with app_cm as (app, client):
        ids = await publish(app.state.deps, 3)
        gateway.policy_plan.append(Fail(500))
        r = await client.post("/v1/rl/training/runs")
        assert code(r) == (502, "gateway_unavailable")
        assert not await redis.exists(keys.ACTIVE_RUN)
        assert await statuses(redis, ids) == ["pending"] * 3
        assert backend.calls == []


async def test_success_claims_oldest_trains_publishes_and_activates(make_service, gateway, redis, tmp_path):
    app_cm, backend = make_service()
    async with app_cm as (app, client):
        deps = app.state.deps
        ids = await publish(deps, 5)
        r = await client.post("/v1/rl/training/runs", json={})
        assert r.status_code == 201
        run = r.json()
        assert set(run) >= {"training_run_id", "status", "stage", "sample_count", "policy_versions", "metrics"}
        assert not {"sample_ids", "parent_lora_name", "parent_lora_path"} & set(run)
        assert (run["status"], run["stage"], run["sample_count"]) == ("pending", "queued", 3)
        assert run["policy_versions"] == {"base": 3}
        done = await wait_for_run(deps.runner, run["training_run_id"])
        assert (done.status, done.stage) == ("succeeded", "activating")
        assert done.lora_name == f"{MODEL_ID}:v1"
        lora_path = Path(done.lora_path)
        assert lora_path == (tmp_path / "loras" / MODEL_ID / "v1").resolve()
        meta = orjson.loads((lora_path / "metadata.json").read_bytes())
        assert (meta["training_run_id"], meta["sample_count"], meta["training_source"]) == (
            done.training_run_id, 3, "base_model")
        assert meta["reward_avg"] == 1.0 and meta["lora_name"] == f"{MODEL_ID}:v1"
        assert gateway.activations == [{
            "base_model": "/models/tiny", "lora_name": f"{MODEL_ID}:v1", "lora_path": str(lora_path),
            "expected_lora_name": "base", "training_run_id": done.training_run_id,
        }]
        marker = orjson.loads((tmp_path / "loras" / MODEL_ID / "active").read_bytes())
        assert marker["lora_name"] == f"{MODEL_ID}:v1"
        assert backend.calls[0]["sample_ids"] == ids[:3]  # the oldest three, in claim order
        assert await statuses(redis, ids) == ["trained"] * 3 + ["pending"] * 2
        stats = (await client.get("/v1/rl/trajectories/stats")).json()
        assert stats["by_status"] == {"pending": 2, "training": 0, "trained": 3, "failed": 0}
        assert not await redis.exists(keys.ACTIVE_RUN)
        assert await redis.ttl(keys.training_run(done.training_run_id)) > 0
        public = (await client.get(f"/v1/rl/training/runs/{done.training_run_id}")).json()
        assert public["status"] == "succeeded" and public["metrics"]["steps"] == 1
        # The next run starts from the new version.
        await publish(deps, 1, start=5, policy=f"{MODEL_ID}:v1")
        second = (await client.post("/v1/rl/training/runs")).json()
        done2 = await wait_for_run(deps.runner, second["training_run_id"])
        assert done2.lora_name == f"{MODEL_ID}:v2" and done2.status == "succeeded"
        assert gateway.activations[-1]["expected_lora_name"] == f"{MODEL_ID}:v1"
        assert second["policy_versions"] == {"base": 2, f"{MODEL_ID}:v1": 1}


async def test_active_run_is_reused_and_stop_restores(make_service, redis):
    app_cm, backend = make_service()
    backend.plan = {"outcome": "block"}
    async with app_cm as (app, client):
        ids = await publish(app.state.deps, 4)
        first = await client.post("/v1/rl/training/runs")
        again = await client.post("/v1/rl/training/runs", content=b"null")
        assert (first.status_code, again.status_code) == (201, 200)
        run_id = first.json()["training_run_id"]
        assert again.json()["training_run_id"] == run_id
        while not backend.calls:  # the execution task reaches the backend on its first turn of the loop
            await asyncio.sleep(0.01)
        assert await statuses(redis, ids) == ["training"] * 3 + ["pending"]
        # A sample arriving mid-run stays pending for the next run.
        late = await publish(app.state.deps, 1, start=10)
        stopped = await client.post(f"/v1/rl/training/runs/{run_id}/stop")
        assert (stopped.json()["status"], stopped.json()["stage"]) == ("canceled", "training")
        assert (await client.post(f"/v1/rl/training/runs/{run_id}/stop")).json() == stopped.json()
        assert len(backend.calls) == 1
        assert await statuses(redis, ids + late) == ["pending"] * 5
        assert not await redis.exists(keys.ACTIVE_RUN)
        # Restored samples keep their place: the next claim takes the same oldest three.
        backend.plan = {"outcome": "succeed"}
        nxt = (await client.post("/v1/rl/training/runs")).json()
        await wait_for_run(app.state.deps.runner, nxt["training_run_id"])
        assert backend.calls[-1]["sample_ids"] == ids[:3]


async def test_trainer_failure_restores_samples(make_service, redis, gateway):
    app_cm, backend = make_service()
    backend.plan = {"outcome": "fail", "message": "CUDA out of memory (scripted)"}
    async with app_cm as (app, client):
        ids = await publish(app.state.deps, 3)
        run = (await client.post("/v1/rl/training/runs")).json()
        done = await wait_for_run(app.state.deps.runner, run["training_run_id"])
        assert (done.status, done.failure_reason, done.stage) == ("failed", "CUDA out of memory (scripted)", "training")
        assert await statuses(redis, ids) == ["pending"] * 3
        assert gateway.activations == []
        assert not list((Path(app.state.deps.config.lora_repository_path) / MODEL_ID).glob(".tmp-*"))


async def test_dropped_samples_are_marked_failed(make_service, redis):
    app_cm, backend = make_service()
    async with app_cm as (app, client):
        ids = await publish(app.state.deps, 3)
        backend.plan = {"outcome": "succeed", "drop": [ids[1]]}
        run = (await client.post("/v1/rl/training/runs")).json()
        await wait_for_run(app.state.deps.runner, run["training_run_id"])
        assert await statuses(redis, ids) == ["trained", "failed", "trained"]


async def test_cas_conflict_fails_without_retry_and_keeps_artifact(make_service, gateway, redis):
    gateway.active = (f"{MODEL_ID}:v7", "/elsewhere/v7")
    app_cm, _ = make_service()
    async with app_cm as (app, client):
        ids = await publish(app.state.deps, 3)
        run = (await client.post("/v1/rl/training/runs")).json()
        # The gateway switched between the parent read and the activation.
        gateway.active = (f"{MODEL_ID}:v8", "/elsewhere/v8")
        done = await wait_for_run(app.state.deps.runner, run["training_run_id"])
        assert done.status == "failed"
        assert done.failure_reason.startswith("activation status 409: ")
        assert len(gateway.activations) == 1
        assert Path(done.lora_path, "metadata.json").is_file()
        assert await statuses(redis, ids) == ["trained"] * 3


async def test_5xx_is_retried_then_succeeds(make_service, gateway):
    gateway.activate_plan.extend([Fail(503), Fail(502)])
    app_cm, _ = make_service(lora_activation_timeout=8.0)
    async with app_cm as (app, client):
        await publish(app.state.deps, 3)
        run = (await client.post("/v1/rl/training/runs")).json()
        started = time.monotonic()
        done = await wait_for_run(app.state.deps.runner, run["training_run_id"])
        assert done.status == "succeeded"
        assert len(gateway.activations) == 3
        assert 2.5 <= time.monotonic() - started < 7  # backoff 1 s then 2 s


async def test_timeout_reconciled_by_policy_read(make_service, gateway):
    gateway.activate_plan.append(Hang(10.0, switch=True))
    app_cm, _ = make_service(lora_activation_timeout=1.5, lora_activation_attempts=1)
    async with app_cm as (app, client):
        await publish(app.state.deps, 3)
        run = (await client.post("/v1/rl/training/runs")).json()
        done = await wait_for_run(app.state.deps.runner, run["training_run_id"])
        assert done.status == "succeeded"
        assert gateway.active[0] == done.lora_name


async def test_timeout_without_switch_fails(make_service, gateway):
    gateway.activate_plan.append(Hang(10.0, switch=False))
    app_cm, _ = make_service(lora_activation_timeout=1.5, lora_activation_attempts=1)
    async with app_cm as (app, client):
        await publish(app.state.deps, 3)
        run = (await client.post("/v1/rl/training/runs")).json()
        done = await wait_for_run(app.state.deps.runner, run["training_run_id"])
        assert (done.status, done.failure_reason) == ("failed", "LoRA activation request timed out")


@pytest.mark.parametrize("switched", [True, False])
async def test_stop_during_activation_records_the_truth(make_service, gateway, switched):
    gateway.activate_plan.append(Hang(10.0, switch=switched))
    app_cm, _ = make_service(lora_activation_timeout=20.0)
    async with app_cm as (app, client):
        await publish(app.state.deps, 3)
        run_id = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
        while not gateway.activations:
            await asyncio.sleep(0.02)
        stopped = (await client.post(f"/v1/rl/training/runs/{run_id}/stop")).json()
        assert stopped["stage"] == "activating"
        assert stopped["status"] == ("succeeded" if switched else "canceled")


async def test_stop_as_training_completes_keeps_artifact_without_activation(make_service, gateway, redis):
    app_cm, backend = make_service()
    async with app_cm as (app, client):
        ids = await publish(app.state.deps, 3)
        runner = app.state.deps.runner
        run_id = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
        runner._executions.request_stop(run_id)  # the stop arrives while train() returns its artifact
        done = await wait_for_run(runner, run_id)
        assert (done.status, done.stage) == ("canceled", "activating")
        assert Path(done.lora_path, "metadata.json").is_file()
        assert gateway.activations == []
        assert await statuses(redis, ids) == ["trained"] * 3


async def test_recovery_of_a_run_interrupted_while_training(make_service, redis):
    app_cm, backend = make_service()
    backend.plan = {"outcome": "block"}
    async with app_cm as (app, client):
        ids = await publish(app.state.deps, 3)
        run_id = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
        while not backend.calls:
            await asyncio.sleep(0.01)
        # The crash state, captured before the graceful shutdown settles the run.
        crash = {key: await redis.dump(key) for key in await _run_and_sample_keys(redis, run_id, ids)}
    await _restore(redis, crash)
    assert await statuses(redis, ids) == ["training"] * 3
    app_cm, backend = make_service()
    async with app_cm as (app, client):
        recovered = (await client.get(f"/v1/rl/training/runs/{run_id}")).json()
        assert (recovered["status"], recovered["failure_reason"]) == ("failed", "service_restarted")
        assert await statuses(redis, ids) == ["pending"] * 3
        stats = (await client.get("/v1/rl/trajectories/stats")).json()
        assert stats["by_status"]["pending"] == 3 and stats["by_status"]["training"] == 0
        assert not await redis.exists(keys.ACTIVE_RUN)
        assert backend.calls == []


async def test_recovery_of_a_run_interrupted_while_activating(make_service, gateway, redis):
    gateway.activate_plan.append(Hang(10.0, switch=False))
    app_cm, _ = make_service(lora_activation_timeout=20.0)
    async with app_cm as (app, client):
        ids = await publish(app.state.deps, 3)
        run_id = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
        while not gateway.activations:
            await asyncio.sleep(0.02)
        crash = {key: await redis.dump(key) for key in await _run_and_sample_keys(redis, run_id, ids)}
    await _restore(redis, crash)
    app_cm, _ = make_service()
    async with app_cm as (app, client):
        recovered = (await client.get(f"/v1/rl/training/runs/{run_id}")).json()
        assert (recovered["status"], recovered["stage"]) == ("succeeded", "activating")
        assert len(gateway.activations) == 2
        assert gateway.activations[1] == gateway.activations[0]  # same artifact, same parent (CAS on base)
        assert gateway.active[0] == recovered["lora_name"]
        assert await statuses(redis, ids) == ["trained"] * 3


async def _run_and_sample_keys(redis, run_id, ids):
    owned = [keys.training_run(run_id), keys.ACTIVE_RUN, f"rl:v1:traj_stats:{MODEL_ID}"]
    owned += [f"rl:v1:traj_idx:{MODEL_ID}:{s}" for s in ("pending", "training", "trained", "failed")]
    owned += [keys.traj(i) for i in ids]
    return [k for k in owned if await redis.exists(k)]


async def _restore(redis, dumped):
    async for key in redis.scan_iter(match="rl:v1:traj_idx:*"):
        await redis.delete(key)
    for key, value in dumped.items():
        await redis.restore(key, 0, value, replace=True)


async def test_routes_404_and_bad_bodies(make_service):
    app_cm, _ = make_service()
    async with app_cm as (_, client):
        for path in ("/v1/rl/training/runs/run-000000000000", "/v1/rl/training/runs/nope"):
            assert code(await client.get(path)) == (404, "training_run_not_found")
            assert code(await client.post(path + "/stop")) == (404, "training_run_not_found")
        assert code(await client.post("/v1/rl/training/runs", json={"x": 1})) == (400, "invalid_training_request")
        assert code(await client.post("/v1/rl/training/runs", json=[1])) == (400, "invalid_training_request")
        assert code(await client.post("/v1/rl/training/runs", content=b"{oops")) == (400, "invalid_request")


async def test_health_reflects_a_failing_backend(make_service):
    app_cm, backend = make_service()
    async with app_cm as (_, client):
        assert (await client.get("/health")).status_code == 200
        backend.health_error = "ray actor died"
        r = await client.get("/health")
        assert code(r) == (503, "service_not_ready") and "ray actor died" in r.json()["error"]["message"]


async def test_concurrent_starts_from_two_instances_make_one_run(make_service, redis):
    app_a, backend_a = make_service()
    app_b, backend_b = make_service()
    backend_a.plan = backend_b.plan = {"outcome": "block"}
    async with app_a as (app, a), app_b as (_, b):
        await publish(app.state.deps, 6)
        results = await asyncio.gather(*(c.post("/v1/rl/training/runs") for c in (a, b, a, b)))
        assert sorted(r.status_code for r in results) == [200, 200, 200, 201]
        assert len({r.json()["training_run_id"] for r in results}) == 1
        stats = (await a.get("/v1/rl/trajectories/stats")).json()
        assert stats["by_status"]["training"] == 3 and stats["by_status"]["pending"] == 3


async def test_stale_samples_are_excluded_under_max_policy_lag(make_service, gateway, redis):
    gateway.active = (f"{MODEL_ID}:v3", "/loras/v3")
    app_cm, backend = make_service(max_policy_lag=1)
    async with app_cm as (app, client):
        old = await publish(app.state.deps, 2, policy="base")
        v2 = await publish(app.state.deps, 1, policy=f"{MODEL_ID}:v2", start=2)
        assert code(await client.post("/v1/rl/training/runs")) == (409, "insufficient_samples")
        # The run start read the active policy (v3): the two base samples lag 3 > 1 and leave `pending` as
        # `outdated` (counted, never claimed); the v2 sample (lag 1) stays.
        stats = (await client.get("/v1/rl/trajectories/stats")).json()
        assert (stats["stale"], stats["by_status"]["outdated"], stats["by_status"]["pending"]) == (0, 2, 1)
        assert await statuses(redis, old) == ["outdated", "outdated"]
        v3 = await publish(app.state.deps, 2, policy=f"{MODEL_ID}:v3", start=3)
        run = (await client.post("/v1/rl/training/runs")).json()
        assert run["policy_versions"] == {f"{MODEL_ID}:v2": 1, f"{MODEL_ID}:v3": 2}
        assert run["metrics"]["stale_excluded"] == 0  # none left pending to exclude
        await wait_for_run(app.state.deps.runner, run["training_run_id"])
        assert backend.calls[0]["sample_ids"] == v2 + v3
        assert await statuses(redis, old) == ["outdated", "outdated"]
        report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
        assert [v for v in report.violations if "which has no record" not in v] == []


# A run record that vanishes under a running service (deleted by hand, lost with Redis data): the routes answer
# 404 `training_run_not_found`, the execution ends without a sticky failure (/health stays 200), the batch goes back
# to `pending` and the active pointer is released, so the next run can claim.

async def _wait_settled(redis, ids, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await redis.exists(keys.ACTIVE_RUN) or await statuses(redis, ids) != ["pending"] * len(ids):
        assert time.monotonic() < deadline, "the vanished run's batch was never released"
        await asyncio.sleep(0.05)


async def test_run_record_vanishing_while_training_keeps_the_service_healthy(make_service, redis):
    app_cm, backend = make_service()
    backend.plan = {"outcome": "succeed", "delay_seconds": 1.0}  # training reports progress after the delay
    async with app_cm as (app, client):
        ids = await publish(app.state.deps, 3)
        run_id = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
        while not backend.calls:
            await asyncio.sleep(0.01)
        await redis.delete(keys.training_run(run_id))
        await _wait_settled(redis, ids)
        execution = app.state.deps.runner._executions.task(run_id)
        if execution is not None:
            await asyncio.gather(execution, return_exceptions=True)
        health = await client.get("/health")
        assert health.status_code == 200, health.text
        assert code(await client.get(f"/v1/rl/training/runs/{run_id}")) == (404, "training_run_not_found")
        assert code(await client.post(f"/v1/rl/training/runs/{run_id}/stop")) == (404, "training_run_not_found")
        assert code(await client.get(f"/v1/rl/training/runs/{run_id}/events")) == (404, "training_run_not_found")
        # The released batch trains in the next run.
        backend.plan = {"outcome": "succeed"}
        nxt = await client.post("/v1/rl/training/runs")
        assert nxt.status_code == 201, nxt.text
        done = await wait_for_run(app.state.deps.runner, nxt.json()["training_run_id"])
        assert done.status == "succeeded" and backend.calls[-1]["sample_ids"] == ids
        assert (await client.get("/health")).status_code == 200


async def test_run_record_vanishing_during_a_stop_is_404(make_service, gateway, redis):
    """The stop of an activating run reads the gateway's policy before it writes the outcome; the record is
    deleted during that read."""
    gateway.activate_plan.append(Hang(10.0, switch=False))
    app_cm, _ = make_service(lora_activation_timeout=20.0)
    async with app_cm as (app, client):
        await publish(app.state.deps, 3)
        run_id = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
        while not gateway.activations:
            await asyncio.sleep(0.02)
        gateway.policy_plan.append(Hang(1.0))
        reads = gateway.policy_reads
        stop = asyncio.create_task(client.post(f"/v1/rl/training/runs/{run_id}/stop"))
        while gateway.policy_reads == reads:
            await asyncio.sleep(0.01)
        await redis.delete(keys.training_run(run_id))
        assert code(await stop) == (404, "training_run_not_found")
        assert not await redis.exists(keys.ACTIVE_RUN)
        assert (await client.get("/health")).status_code == 200
