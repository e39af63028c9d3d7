"""Recovery from faults found by the chaos suite (docs/reliability.md), each reproduced in-process and checked with
the invariant checker: a turn publication cut by a crash is rolled back, one whose publisher failed to roll back is
taken over, a reward projection cut by a crash is finished at startup, and a Training Run's execution outlives a
Redis pause instead of leaving its run stuck."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from tests.conftest import load_fixture
from tests.support.fake_gateway import FakeGateway
from tests.support.fake_judge import FakeJudge
from tests.support.invariants import check_invariants
from tests.support.redis_server import RedisServer
from tests.support.service_app import MODEL_ID, capture, make_config, running_app, start_task, with_user
from tests.support.runs import wait_for_run

REQUEST, RESPONSE = load_fixture("chat_request.json"), load_fixture("chat_response.json")


async def commit_turn(client, t: str, c: str, turn: str) -> None:
    before, after = await capture(client, t, c, with_user(REQUEST, turn), RESPONSE, turn=turn)
    assert before.status_code == 200 and after is not None and after.status_code == 204, before.text


async def publication_cut_after_insert(deps, t: str, turn: str) -> str:
    """The state a publisher leaves when it dies between inserting the turn's judged samples and completing."""
    assert await deps.turns.claim_publish(t, turn) == "claimed"
    staged = await deps.turns.turn_staged(t, turn)
    samples = [PackedSample.decode_staged(blob) for _, blob in staged]
    for sample in samples:
        sample.meta["judge"] = {"score": 0.8, "source": "judge", "tag": "feedback"}
    inserted = await deps.samples.publisher.insert_if_absent(samples)
    assert len(inserted) == 1
    return inserted[0]


@pytest.fixture
async def judge():
    async with FakeJudge() as j:
        yield j


async def test_recovery_rolls_back_a_turn_publication_cut_by_a_crash(redis, redis_url, tmp_path, judge):
    config = make_config(redis_url, tmp_path, judge_endpoint=judge.url, judge_model="judge")
    async with running_app(config) as (crashed, client):
        await start_task(client, "s1", "t1", mode="delayed_feedback")
        await commit_turn(client, "t1", "c1", "u1")
        sample_id = await publication_cut_after_insert(crashed.state.deps, "t1", "u1")
        # The process "dies" here; another one starts on the same Redis and recovers.
        async with running_app(config) as (_, restarted):
            task = (await restarted.get("/v1/rl/tasks/t1")).json()
            assert (task["status"], task["finish_reason"]) == ("aborted", "service_restarted")
            assert (await restarted.get(f"/v1/rl/trajectories/{sample_id}")).status_code == 404
            assert await redis.get(keys.turn_publish("t1", "u1")) == b"failed"
            assert (await restarted.get("/v1/rl/trajectories/stats")).json()["total"] == 0
            await check_invariants(redis, model_id=MODEL_ID, strict_active_index=True)


async def test_next_turn_takes_over_a_publication_whose_publisher_failed_to_roll_back(redis, redis_url, tmp_path,
                                                                                       judge):
    config = make_config(redis_url, tmp_path, judge_endpoint=judge.url, judge_model="judge")
    async with running_app(config) as (app, client):
        await start_task(client, "s1", "t1", mode="delayed_feedback")
        await commit_turn(client, "t1", "c1", "u1")
        sample_id = await publication_cut_after_insert(app.state.deps, "t1", "u1")
        # Before: the next turn waited for the dead publisher until the deadline, then aborted the Task.
        await commit_turn(client, "t1", "c2", "u2")
        assert (await client.get("/v1/rl/tasks/t1")).json()["status"] == "active"
        assert await redis.get(keys.turn_publish("t1", "u1")) == b"published"
        detail = (await client.get(f"/v1/rl/trajectories/{sample_id}")).json()
        assert detail["judge"]["tag"] == "feedback" and detail["judge"]["votes"] == [8.0]  # judged again, once
        assert len(judge.requests) == 1 and "u2" in judge.requests[0].prompt
        await check_invariants(redis, model_id=MODEL_ID)


async def test_stop_takes_over_a_publication_whose_publisher_failed_to_roll_back(redis, redis_url, tmp_path, judge):
    config = make_config(redis_url, tmp_path, judge_endpoint=judge.url, judge_model="judge")
    async with running_app(config) as (app, client):
        await start_task(client, "s1", "t1", mode="delayed_feedback")
        await commit_turn(client, "t1", "c1", "u1")
        sample_id = await publication_cut_after_insert(app.state.deps, "t1", "u1")
        # Before: stop answered 409 "turn publication in progress" for ever, the Task stuck active.
        stopped = await client.post("/v1/rl/tasks/t1/stop")
        assert (stopped.status_code, stopped.json()["status"]) == (200, "finalized"), stopped.text
        detail = (await client.get(f"/v1/rl/trajectories/{sample_id}")).json()
        assert detail["judge"]["tag"] == "session_done" and len(judge.requests) == 1
        await check_invariants(redis, model_id=MODEL_ID, strict_active_index=True)


@contextlib.asynccontextmanager
async def rewarded_samples(tmp_path, count: int, *, socket_timeout_s: float | None = None,
                           train_s: float) -> AsyncIterator[tuple[RedisServer, FakeGateway, Any, Any, ScriptedBackend]]:
    """A service on its own Redis and a fake gateway, with `count` rewarded pending samples: one Training Run's
    batch (`min_samples_for_training` = `max_samples_per_run` = `count`), trained by the scripted backend in
    `train_s`. Yields (Redis server, gateway, app, client, backend)."""
    with RedisServer(tmp_path / "redis") as server:
        async with FakeGateway(model_id=MODEL_ID) as gateway:
            url = server.url if socket_timeout_s is None else f"{server.url}?socket_timeout={socket_timeout_s}"
            config = make_config(
                url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted",
                min_samples_for_training=count, max_samples_per_run=count,
                training_tmp_root=str(tmp_path / "train-tmp"),
            )
            backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
            backend.plan = {"outcome": "succeed", "delay_seconds": train_s}
            async with running_app(config, backend=backend) as (app, client):
                await start_task(client, "s1", "t1")
                for i in range(count):
                    _, after = await capture(client, "t1", f"c{i}", REQUEST, RESPONSE)
                    assert after is not None and after.status_code == 204
                assert (await client.post("/v1/rl/tasks/t1/stop")).status_code == 200
                assert (await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1.0})).status_code == 200
                yield server, gateway, app, client, backend


async def test_training_run_outlives_a_redis_pause(tmp_path):
    async with rewarded_samples(tmp_path, 3, socket_timeout_s=0.5, train_s=0.5) as (server, gateway, app, client,
                                                                                    backend):
        run = await client.post("/v1/rl/training/runs")
        assert run.status_code == 201
        while not backend.calls:
            await asyncio.sleep(0.01)
        server.pause()  # training ends inside the pause: its state writes meet a Redis that does not answer
        try:
            await asyncio.sleep(2.0)
            health = await client.get("/health")
            assert (health.status_code, health.json()["error"]["code"]) == (503, "service_not_ready")
        finally:
            server.resume()
        done = await asyncio.wait_for(wait_for_run(app.state.deps.runner, run.json()["training_run_id"]), 30)
        assert (done.status, done.lora_name) == ("succeeded", "tiny:v1")
        assert gateway.active is not None and gateway.active[0] == "tiny:v1"
        assert (await client.get("/health")).status_code == 200
        stats = (await client.get("/v1/rl/trajectories/stats")).json()
        assert stats["by_status"] == {"pending": 0, "training": 0, "trained": 3, "failed": 0}
        redis = Redis.from_url(server.url)
        try:
            report = await check_invariants(redis, model_id=MODEL_ID, strict_active_index=True)
            assert report.samples_by_status["trained"] == 3
        finally:
            await redis.aclose()


async def test_startup_finishes_a_reward_projection_cut_by_a_crash(redis, redis_url, tmp_path):
    config = make_config(redis_url, tmp_path)
    async with running_app(config) as (crashed, client):
        await start_task(client, "s1", "t1")
        for i in range(2):
            _, after = await capture(client, "t1", f"c{i}", REQUEST, RESPONSE)
            assert after is not None and after.status_code == 204
        assert (await client.post("/v1/rl/tasks/t1/stop")).json()["status"] == "finalized"
        # The state of a crash between the reward's claim and its completion: `projecting`, one sample inserted.
        deps = crashed.state.deps
        await redis.set(keys.reward("t1"), orjson.dumps({"reward": 0.5, "status": "projecting", "sample_count": 0}))
        first = PackedSample.decode_staged(await redis.get(keys.staged("t1", "c0")))
        first.meta["judge"] = {"score": 0.5, "source": "terminal"}
        assert await deps.samples.publisher.insert_if_absent([first]) == ["c0"]
        # Nobody repeats the reward: the next process start completes it anyway.
        async with running_app(config) as (_, restarted):
            assert orjson.loads(await redis.get(keys.reward("t1"))) == {
                "reward": 0.5, "status": "published", "sample_count": 2}
            for c in ("c0", "c1"):
                detail = (await restarted.get(f"/v1/rl/trajectories/{c}")).json()
                assert detail["judge"] == {"score": 0.5, "source": "terminal"}
            assert await redis.zscore(keys.TASKS_AWAITING_REWARD, "t1") is None
            assert (await restarted.post("/v1/rl/tasks/t1/reward", json={"reward": 0.5})).json() == {"sample_count": 2}
            await check_invariants(redis, model_id=MODEL_ID, strict_active_index=True)


async def test_training_run_whose_claim_answer_was_lost_still_executes(tmp_path, monkeypatch):
    """Redis applied the claim's EXEC but its answer never came back (a pause longer than the socket timeout, the
    chaos suite's `redis:pause`): the start answers 500, yet the claimed run executes instead of sitting queued
    with its batch claimed, and a second start returns that run."""
    async with rewarded_samples(tmp_path, 2, train_s=0.3) as (server, gateway, app, client, backend):
        runs = app.state.deps.runner._claims
        applied = runs.claim

        async def claim_answer_lost(*args, **kwargs):
            await applied(*args, **kwargs)
            raise RedisTimeoutError("Timeout reading from socket")

        monkeypatch.setattr(runs, "claim", claim_answer_lost)
        lost = await client.post("/v1/rl/training/runs")
        assert (lost.status_code, lost.json()["error"]["code"]) == (500, "internal_error")
        monkeypatch.setattr(runs, "claim", applied)

        redis = Redis.from_url(server.url)
        try:
            run_id = (await redis.get(keys.ACTIVE_RUN)).decode()
            again = await client.post("/v1/rl/training/runs")
            assert (again.status_code, again.json()["training_run_id"]) == (200, run_id)
            done = await asyncio.wait_for(wait_for_run(app.state.deps.runner, run_id), 30)
            for _ in range(200):  # wait() can meet the run between its claim and its launch
                if done.terminal:
                    break
                await asyncio.sleep(0.05)
                done = await wait_for_run(app.state.deps.runner, run_id)
            assert (done.status, done.lora_name, len(backend.calls)) == ("succeeded", "tiny:v1", 1)
            assert gateway.active is not None and gateway.active[0] == "tiny:v1"
            assert (await client.get("/health")).status_code == 200
            report = await check_invariants(redis, model_id=MODEL_ID, strict_active_index=True)
            assert report.samples_by_status["trained"] == 2
        finally:
            await redis.aclose()
