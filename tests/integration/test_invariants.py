"""The invariant checker (tests/support/invariants.py) passes on a state the service built, and names each broken
invariant when the state is corrupted by hand (CONTRACT §5.4)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.sample_status import SampleStatus
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from tests.conftest import load_fixture
from tests.support.fake_gateway import FakeGateway
from tests.support.fake_judge import FakeJudge
from tests.support.invariants import ClientRecord, InvariantViolation, check_invariants, classify_key
from tests.support.service_app import MODEL_ID, capture, make_config, running_app, start_task, with_user

REQUEST, RESPONSE = load_fixture("chat_request.json"), load_fixture("chat_response.json")


async def committed(client, record: ClientRecord, t: str, c: str, turn: str | None = None, text: str = "go") -> None:
    request = with_user(REQUEST, text) if turn else REQUEST
    before, after = await capture(client, t, c, request, RESPONSE, turn=turn)
    assert before.status_code == 200 and after is not None and after.status_code == 204, before.text
    record.capture_committed(t, c, turn)


async def build_state(client, app, backend: ScriptedBackend) -> ClientRecord:
    """Every kind of state at once: rewarded Tasks, a claimed batch, a Task awaiting its reward, an active Task
    with an open capture, an aborted one, a delayed Task with a published turn and one still open."""
    record = ClientRecord()
    for i in range(4):  # 4 rewarded Tasks, 2 captures each: 8 pending samples
        t = f"tr{i}"
        assert (await start_task(client, f"s{t}", t)).status_code == 201
        record.task_started(t)
        for j in range(2):
            await committed(client, record, t, f"{t}-c{j}")
        assert (await client.post(f"/v1/rl/tasks/{t}/stop")).json()["status"] == "finalized"
        record.task_finalized(t)
        r = await client.post(f"/v1/rl/tasks/{t}/reward", json={"reward": 0.25 * i})
        record.reward_acknowledged(t, 0.25 * i, r.json()["sample_count"])
    backend.plan = {"outcome": "block"}
    run = await client.post("/v1/rl/training/runs")
    assert run.status_code == 201, run.text
    while not backend.calls:
        await asyncio.sleep(0.01)
    await start_task(client, "s-wait", "twait")
    await committed(client, record, "twait", "twait-c0")
    assert (await client.post("/v1/rl/tasks/twait/stop")).json()["status"] == "finalized"
    await start_task(client, "s-open", "topen")
    r = await client.post("/internal/v1/completions:before",
                          json={"rl_task_id": "topen", "capture_id": "topen-c0", "request": REQUEST})
    assert r.status_code == 200
    await start_task(client, "s-ab", "tab")
    await committed(client, record, "tab", "tab-c0")
    assert (await client.post("/internal/v1/rl/tasks/tab:abort", json={"reason": "timeout"})).status_code == 200
    await start_task(client, "s-del", "tdel", mode="delayed_feedback")
    record.task_started("tdel", "delayed_feedback")
    await committed(client, record, "tdel", "tdel-u1", turn="u1", text="first")
    await committed(client, record, "tdel", "tdel-u2", turn="u2", text="second")  # publishes u1
    record.turn_published("tdel", "u1")
    return record


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID) as gateway, FakeJudge() as judge:
        config = make_config(
            redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted", min_samples_for_training=3,
            max_samples_per_run=3, judge_endpoint=judge.url, judge_model="judge",
            training_tmp_root=str(tmp_path / "train-tmp"),
        )
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            record = await build_state(client, app, backend)
            yield client, record
            backend.plan = {"outcome": "succeed"}


async def test_a_state_built_by_the_service_holds_every_invariant(service, redis):
    _, record = service
    report = await check_invariants(redis, model_id=MODEL_ID, sent=record)
    assert report.ok
    # 8 rewarded + 1 published turn; 3 of them claimed by the blocked run.
    assert report.samples == 9 and report.samples_by_status == {
        "awaiting_rewards": 0, "pending": 6, "training": 3, "trained": 0, "failed": 0, "evaluation": 0, "excluded": 0,
        "outdated": 0}
    assert report.client_samples_checked == 9 == record.expected_samples
    assert report.runs == 1 and report.tasks == 8


async def _move_to_two_indexes(redis) -> None:
    pending = (await redis.zrange(keys.traj_index(MODEL_ID, "pending"), 0, 0))[0]
    await redis.zadd(keys.traj_index(MODEL_ID, "trained"), {pending: 1.0})


async def _drop_a_sample(redis) -> None:
    await redis.delete(keys.traj("tr1-c0"))
    await redis.zrem(keys.traj_index(MODEL_ID, "pending"), "tr1-c0")
    await redis.hincrby(keys.traj_stats(MODEL_ID), "status:pending", -1)
    await redis.hincrby(keys.traj_stats(MODEL_ID), "source:rl_task", -1)
    await redis.hincrby(keys.traj_stats(MODEL_ID), "pending_policy:base", -1)


async def _claimed_without_run(redis) -> None:
    sample = (await redis.zrange(keys.traj_index(MODEL_ID, "pending"), 0, 0))[0]
    await redis.hset(keys.traj(sample.decode()), mapping={"status": "training", "run_id": "run-000000000000"})
    await redis.zrem(keys.traj_index(MODEL_ID, "pending"), sample)
    await redis.zadd(keys.traj_index(MODEL_ID, "training"), {sample: 1.0})


async def _open_capture_in_aborted_task(redis) -> None:
    await redis.sadd(keys.open_captures("tab"), "ghost")
    await redis.sadd(keys.captures("tab"), "ghost")
    await redis.set(keys.capture("tab", "ghost"), orjson.dumps({"capture_id": "ghost", "status": "open"}))


async def _sample_without_reward(redis) -> None:
    blob = await redis.get(keys.staged("twait", "twait-c0"))
    assert blob is not None
    await redis.hset(keys.traj("twait-c0"), mapping={
        "status": "pending", "rl_task_id": "twait", "source": "rl_task", "policy_version": "base",
        "sample_json": b"{}"})
    await redis.zadd(keys.traj_index(MODEL_ID, "pending"), {"twait-c0": 1.0})
    for field in ("status:pending", "source:rl_task", "pending_policy:base"):
        await redis.hincrby(keys.traj_stats(MODEL_ID), field, 1)


async def _second_active_run(redis) -> None:
    # A second live run of the same (default) lineage: its lineage's pointer names the other one.
    active = (await redis.get(keys.ACTIVE_RUN)).decode()
    record = orjson.loads(await redis.get(keys.training_run(active)))
    record.update(training_run_id="run-0123456789ab", sample_ids=[], sample_count=0)
    await redis.set(keys.training_run("run-0123456789ab"), orjson.dumps(record))


async def _pointer_of_another_lineage(redis) -> None:
    # A lineage's field naming a run of another lineage (the default one's live run).
    active = (await redis.get(keys.ACTIVE_RUN)).decode()
    await redis.hset(keys.ACTIVE_LINEAGE_RUNS, "up", active)


async def _active_task_with_ttl(redis) -> None:
    await redis.expire(keys.task("topen"), 3600)


async def _session_pointer_lost(redis) -> None:
    await redis.delete(keys.active_session("s-open"))


async def _staged_after_publication(redis) -> None:
    await redis.set(keys.staged("tdel", "tdel-u1"), b"blob")


async def _awaiting_without_deadline(redis) -> None:
    # A sample moved to awaiting_rewards (index, counters) whose deadline entry and reward state were never written.
    sample = (await redis.zrange(keys.traj_index(MODEL_ID, "pending"), -1, -1))[0]
    policy = (await redis.hget(keys.traj(sample.decode()), "policy_version")).decode()
    await redis.hset(keys.traj(sample.decode()), "status", SampleStatus.AWAITING_REWARDS)
    await redis.zrem(keys.traj_index(MODEL_ID, "pending"), sample)
    await redis.zadd(keys.traj_index(MODEL_ID, SampleStatus.AWAITING_REWARDS), {sample: 1.0})
    for field, by in (("status:pending", -1), (f"pending_policy:{policy}", -1), ("status:awaiting_rewards", 1)):
        await redis.hincrby(keys.traj_stats(MODEL_ID), field, by)


async def _task_listed_under_two_statuses(redis) -> None:
    await redis.zadd(keys.tasks_by_status("aborted"), {"topen": 1.0})


CORRUPTIONS: dict[str, tuple[Callable[[Any], Awaitable[None]], str]] = {
    "two indexes": (_move_to_two_indexes, "is in 2 status indexes"),
    "counter": (lambda r: r.hincrby(keys.traj_stats(MODEL_ID), "status:pending", 1), "counter status:pending = "),
    "lost sample": (_drop_a_sample, "capture tr1-c0 of rewarded task tr1 has no sample (lost)"),
    "claim without run": (_claimed_without_run, "for run 'run-000000000000', which is not live"),
    "open in terminal": (_open_capture_in_aborted_task, "task tab is aborted with open captures ['ghost']"),
    "sample from nowhere": (_sample_without_reward, "sample twait-c0 comes from no published turn"),
    "two runs": (_second_active_run, "run run-0123456789ab of lineage 'default' is running but its lineage's "
                                     "pointer names"),
    "foreign pointer": (_pointer_of_another_lineage, "the active run pointer of lineage 'up' names"),
    "ttl": (_active_task_with_ttl, "task topen is active but its record has a TTL"),
    "pointer": (_session_pointer_lost, "task topen is active but session s-open points to None"),
    "foreign key": (lambda r: r.set("not-ours", "x"), "key outside the service prefix"),
    "unknown shape": (lambda r: r.set("rl:v1:mystery:thing", "x"), "key with no known shape"),
    "staged twice": (_staged_after_publication, "capture tdel-u1 of a published turn is still staged"),
    "awaiting without deadline": (_awaiting_without_deadline, "awaits rewards but has no deadline entry"),
    "awaiting without state": (_awaiting_without_deadline, "awaits rewards but has no per-source reward state"),
    "listed twice": (_task_listed_under_two_statuses, "task topen is listed under aborted but is active"),
}


async def test_each_corruption_is_named(service, redis):
    """All corruptions at once (one state build keeps this fast): each is reported with its own message."""
    _, record = service
    for corrupt, _ in CORRUPTIONS.values():
        await corrupt(redis)
    try:
        with pytest.raises(InvariantViolation) as raised:
            await check_invariants(redis, model_id=MODEL_ID, sent=record)
        report = await check_invariants(redis, model_id=MODEL_ID, sent=record, raise_on_violation=False)
    finally:
        await redis.delete("not-ours")  # the fixture only cleans the service prefix
    assert not report.ok
    for name, (_, message) in CORRUPTIONS.items():
        assert message in str(raised.value), (name, str(raised.value))
        assert any(message in v for v in report.violations), (name, report.violations)


async def test_client_record_catches_a_reward_count_it_was_not_told(service, redis):
    _, record = service
    record.reward_acknowledged("tr0", 0.0, 3)  # the service acknowledged 2
    report = await check_invariants(redis, model_id=MODEL_ID, sent=record, raise_on_violation=False)
    assert report.violations == ["client: reward of tr0 acknowledged 3 samples, the Task has 2 committed captures"]


def test_key_shapes():
    assert classify_key("rl:v1:task:t1:turn:current") == ("turn_current", {"t": "t1"})
    assert classify_key("rl:v1:task:t1:turn:a:b:captures") == ("turn_captures", {"t": "t1", "u": "a:b"})
    assert classify_key("rl:v1:task:t1:captures:open")[0] == "open_captures"
    assert classify_key("rl:v1:training_run:run-0123456789ab:events")[0] == "run_events"
    assert classify_key("rl:v1:task:t:1") is None
    assert classify_key("rl:v1:reward_deadlines:tiny") == ("reward_deadlines", {"o": "tiny"})
    assert classify_key("rl:v1:tasks:by_created:finalized") == ("tasks_by_status", {"ts": "finalized"})
    assert classify_key("rl:v1:policy_stats:tiny:v3")[0] == "policy_stats"
