"""Evaluation Tasks (issue 15, item 3): started with `"evaluation": true`, their samples enter the `evaluation` status,
count in the per-version evaluation of `GET /v1/rl/policies` and are never claimed by a Training Run — even when they
are the oldest samples in the store. Real Redis, the service app with its routes and the scripted trainer."""

from __future__ import annotations

import time

import pytest

from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.sample_status import SampleStatus
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from openjiuwen.agent_evolving.agent_rl.online.store.fence import UNFENCED
from tests.conftest import load_fixture
from tests.support.fake_gateway import FakeGateway
from tests.support.invariants import check_invariants
from tests.support.samples import sample_status
from tests.support.service_app import MODEL_ID, capture, make_config, running_app, start_headers
from tests.support.runs import wait_for_run

REQUEST, RESPONSE = load_fixture("chat_request.json"), load_fixture("chat_response.json")


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID) as gw:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gw.url, trainer_backend="scripted",
                             min_samples_for_training=2, max_samples_per_run=8, lora_activation_timeout=3.0,
                             training_tmp_root=str(tmp_path / "train-tmp"))
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            yield app, client


_ABSENT = object()


async def start(client, n: int, *, evaluation=_ABSENT, mode: str = "terminal"):
    body = {"reward_mode": mode} if evaluation is _ABSENT else {"reward_mode": mode, "evaluation": evaluation}
    return await client.post("/v1/rl/tasks/start", json=body, headers=start_headers(f"s{n}", f"t{n}"))


async def rewarded(client, n: int, reward: float, *, evaluation: bool, captures: int = 1) -> None:
    """One terminal Task: start, `captures` completions, stop, reward (publishes its samples)."""
    assert (await start(client, n, evaluation=evaluation)).status_code == 201
    for k in range(captures):
        _, after = await capture(client, f"t{n}", f"c{n}-{k}", REQUEST, RESPONSE)
        assert after is not None and after.status_code == 204, after and after.text
    assert (await client.post(f"/v1/rl/tasks/t{n}/stop")).status_code == 200
    assert (await client.post(f"/v1/rl/tasks/t{n}/reward", json={"reward": reward})).json() == {
        "sample_count": captures}


async def test_start_field_is_validated_and_recorded(service):
    _, client = service
    for bad in ("yes", 1, 0, None, [], {}):
        r = await start(client, 1, evaluation=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["code"] == "invalid_task_request", bad
    r = await client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal", "evaluate": True},
                          headers=start_headers("s1", "t1"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_task_request"
    r = await client.post("/v1/rl/tasks/start", json={"evaluation": True}, headers=start_headers("s1", "t1"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_task_request"

    r = await start(client, 1, evaluation=True)
    assert r.status_code == 201 and r.json()["evaluation"] is True
    assert (await start(client, 1, evaluation=True)).status_code == 200  # idempotent repeat
    r = await start(client, 1, evaluation=False)  # the same Task id with another spec
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_conflict"
    assert (await client.get("/v1/rl/tasks/t1")).json()["evaluation"] is True
    events = (await client.get("/v1/rl/tasks/t1/events")).json()["items"]
    assert events[0]["type"] == "created" and events[0]["data"]["evaluation"] is True
    # Without the field a Task is a training Task, as before.
    assert (await start(client, 2)).json()["evaluation"] is False
    assert (await start(client, 3, evaluation=False)).json()["evaluation"] is False


async def test_evaluation_samples_are_never_claimed_even_when_oldest(service, redis):
    app, client = service
    # Evaluation traffic first: its samples are the oldest of the store.
    await rewarded(client, 1, 1.0, evaluation=True, captures=2)
    await rewarded(client, 2, 0.0, evaluation=True)
    stats = (await client.get("/v1/rl/trajectories/stats")).json()
    assert stats["by_status"] == {"pending": 0, "training": 0, "trained": 0, "failed": 0, "evaluation": 3}
    assert stats["total"] == 3
    # Three stored samples but none eligible: no run starts (min 2).
    r = await client.post("/v1/rl/training/runs")
    assert r.status_code == 409 and r.json()["error"]["code"] == "insufficient_samples", r.text
    assert "pending samples 0 " in r.json()["error"]["message"]

    await rewarded(client, 3, 1.0, evaluation=False)
    await rewarded(client, 4, 0.5, evaluation=False)
    r = await client.post("/v1/rl/training/runs")
    assert r.status_code == 201, r.text
    run = await wait_for_run(app.state.deps.runner, r.json()["training_run_id"])
    assert run.status == "succeeded", run.failure_reason
    # max_samples_per_run 8 would have room for all five: only the two training samples were claimed.
    assert sorted(run.sample_ids) == ["c3-0", "c4-0"]
    stats = (await client.get("/v1/rl/trajectories/stats")).json()
    assert stats["by_status"] == {"pending": 0, "training": 0, "trained": 2, "failed": 0, "evaluation": 3}
    assert stats["total"] == 5
    listed = (await client.get("/v1/rl/trajectories", params={"status": "evaluation"})).json()["items"]
    assert sorted(i["sample_id"] for i in listed) == ["c1-0", "c1-1", "c2-0"]
    assert {i["status"] for i in listed} == {"evaluation"}
    assert (await client.get("/v1/rl/trajectories/c1-0")).json()["status"] == "evaluation"
    await check_invariants(redis, model_id=MODEL_ID)


async def test_counted_per_version_in_policies(service, redis):
    _, client = service
    await rewarded(client, 1, 1.0, evaluation=True, captures=2)  # one reward observation per Task
    await rewarded(client, 2, 0.5, evaluation=True)
    await rewarded(client, 3, 0.0, evaluation=False)
    assert (await start(client, 4, evaluation=True)).status_code == 201  # an evaluation Task without samples yet
    (base,) = (await client.get("/v1/rl/policies")).json()["items"]
    assert (base["tasks"], base["samples"], base["reward"]["n"]) == (4, 4, 3)
    assert base["reward"]["mean"] == pytest.approx(0.5)
    ev = base["evaluation"]
    assert (ev["tasks"], ev["samples"], ev["reward"]["n"]) == (3, 3, 2)
    assert ev["reward"]["mean"] == pytest.approx(0.75) and ev["reward"]["ci95"] is not None
    await check_invariants(redis, model_id=MODEL_ID)


async def test_retention_removes_old_evaluation_samples_and_keeps_the_aggregates(service, redis):
    app, client = service
    await rewarded(client, 1, 1.0, evaluation=True)
    await rewarded(client, 2, 0.0, evaluation=False)
    store = app.state.deps.samples
    sweep = store.deletion.sweep_expired
    assert await sweep(store.line, fence=UNFENCED, retention_seconds=3600, now=time.time()) == 0  # not old yet
    # pending never expires
    assert await sweep(store.line, fence=UNFENCED, retention_seconds=3600, now=time.time() + 7200) == 1
    documents = store.documents
    assert await sample_status(documents, "c1-0") is None and await sample_status(documents, "c2-0") == "pending"
    stats = (await client.get("/v1/rl/trajectories/stats")).json()
    assert stats["by_status"] == {"pending": 1, "training": 0, "trained": 0, "failed": 0} and stats["total"] == 1
    (base,) = (await client.get("/v1/rl/policies")).json()["items"]
    assert (base["evaluation"]["samples"], base["evaluation"]["reward"]["n"]) == (1, 1)


async def test_rolled_back_publication_removes_evaluation_samples(service, redis):
    app, client = service
    await rewarded(client, 1, 1.0, evaluation=True)
    # A failed publication's roll-back (turn publisher) deletes what it inserted, evaluation samples included.
    assert await app.state.deps.samples.deletion.delete_pending(["c1-0"]) == 1
    (base,) = (await client.get("/v1/rl/policies")).json()["items"]
    assert base["samples"] == 0 and base["evaluation"]["samples"] == 0
    assert (await client.get("/v1/rl/trajectories/stats")).json()["total"] == 0


async def test_invariant_checker_flags_a_trainable_evaluation_sample(service, redis):
    app, client = service
    await rewarded(client, 1, 1.0, evaluation=True)
    await check_invariants(redis, model_id=MODEL_ID)
    store = app.state.deps.samples
    # Move it to `pending` consistently (hash, indexes, counters in one EXEC): only the evaluation rule can object.
    # The sample table forbids this move (`queue_move` raises), so the test writes what such a move would write.
    stats = keys.traj_stats(store.line.owner)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.traj("c1-0"), mapping={"status": "pending", "updated_at": "2026-01-01T00:00:00+00:00"})
        pipe.zrem(store.line.index_key(SampleStatus.EVALUATION), "c1-0")
        pipe.zadd(store.line.index_key("pending"), {"c1-0": 1.0})
        pipe.hincrby(stats, f"status:{SampleStatus.EVALUATION}", -1)
        pipe.hincrby(stats, "status:pending", 1)
        pipe.hincrby(stats, "pending_policy:base", 1)
        await pipe.execute()
    report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
    assert report.violations == ["task t1 is an evaluation Task but its sample c1-0 is pending: it could be "
                                 "trained on"], report.describe()


async def test_under_a_reward_policy_evaluation_samples_skip_the_wait_and_take_rewards(redis, redis_url, tmp_path):
    from tests.integration.test_rewards import POLICY

    async with running_app(make_config(redis_url, tmp_path, reward_policy=POLICY)) as (_, client):
        await rewarded(client, 1, 0.6, evaluation=True)
        # Never `awaiting_rewards` (it will never be trained, so nothing waits for its late sources) and no deadline.
        assert (await client.get("/v1/rl/trajectories/c1-0")).json()["status"] == "evaluation"
        assert await redis.zcard(keys.reward_deadlines(MODEL_ID)) == 0
        r = await client.post("/v1/rl/trajectories/c1-0/rewards", json={"source": "business", "score": 1.0})
        assert r.status_code == 200 and (r.json()["recorded"], r.json()["status"]) == (True, "evaluation"), r.text
        assert (await client.get("/v1/rl/trajectories/c1-0")).json()["rewards"]["sources"]["business"]["kind"] == (
            "arrived")
        stats = (await client.get("/v1/rl/trajectories/stats")).json()
        assert (stats["by_status"]["awaiting_rewards"], stats["by_status"]["evaluation"]) == (0, 1)
        await check_invariants(redis, model_id=MODEL_ID)


async def test_delayed_feedback_evaluation_turns_are_judged_into_evaluation(redis, redis_url, tmp_path):
    from tests.support.fake_judge import FakeJudge, Verdict
    from tests.support.service_app import with_user

    async with FakeJudge() as judge:
        config = make_config(redis_url, tmp_path, judge_endpoint=judge.url, judge_model="judge", judge_retries=0,
                             judge_timeout=5.0, turn_publish_timeout_seconds=2.0)
        async with running_app(config) as (_, client):
            assert (await start(client, 1, evaluation=True, mode="delayed_feedback")).status_code == 201
            _, after = await capture(client, "t1", "c1", REQUEST, RESPONSE, turn="u1")
            assert after.status_code == 204
            judge.enqueue(Verdict(6), Verdict(8))
            # The next turn's first completion publishes turn u1 through the Judge; stopping publishes u2.
            _, after = await capture(client, "t1", "c2", with_user(REQUEST, "good"), RESPONSE, turn="u2")
            assert after.status_code == 204
            assert (await client.post("/v1/rl/tasks/t1/stop")).status_code == 200
            stats = (await client.get("/v1/rl/trajectories/stats")).json()
            assert stats["by_status"]["evaluation"] == 2 and stats["by_status"]["pending"] == 0
            (base,) = (await client.get("/v1/rl/policies")).json()["items"]
            ev = base["evaluation"]
            assert (ev["tasks"], ev["samples"], ev["reward"]["n"]) == (1, 2, 2)
            assert ev["reward"]["mean"] == pytest.approx(0.7)
            await check_invariants(redis, model_id=MODEL_ID)
