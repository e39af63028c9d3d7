"""Rewards from several late sources against a real Redis (docs/rewards.md): the awaiting_rewards state, the
rewards routes, deadlines and fallbacks, stats, the run claim, concurrent sweepers and a crash mid-sweep."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from openjiuwen.agent_evolving.agent_rl.common.ids import now_iso
from openjiuwen.agent_evolving.agent_rl.online.rewards.config import RewardPolicyConfig
from openjiuwen.agent_evolving.agent_rl.online.rewards.ledger import RewardLedger
from openjiuwen.agent_evolving.agent_rl.online.rewards.reward_policy import RewardPolicy
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.sample_status import ALL_SAMPLE_STATUSES, SAMPLE_STATUSES
from openjiuwen.agent_evolving.agent_rl.online.assembly import SampleStore, make_sample_store
from openjiuwen.agent_evolving.agent_rl.online.training.run_records import TrainingRun, new_run_id
from openjiuwen.agent_evolving.agent_rl.online.training.run_claims import RunClaims
from openjiuwen.agent_evolving.agent_rl.online.store.fence import UNFENCED
from tests.conftest import load_fixture
from tests.integration.test_trajectory_store import make_doc, move, packed
from tests.support.service_app import MODEL_ID, capture, make_config, running_app, start_task

REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")

# Judge + business metric in an hour (default 0 when it never comes) + human review tomorrow (skipped if absent).
POLICY = {
    "aggregation": "weighted_mean",
    "sources": {
        "terminal": {"weight": 1.0},
        "judge": {"weight": 1.0},
        "business": {"weight": 3.0, "deadline_seconds": 3600, "fallback": "default", "default_score": 0.0},
        "human": {"weight": 1.0, "deadline_seconds": 86400, "fallback": "skip"},
    },
}
STATUSES = ALL_SAMPLE_STATUSES


def code(resp: Any) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


def make_store(redis: Redis, policy: dict[str, Any] | None = POLICY) -> tuple[SampleStore, RewardLedger]:
    reward_policy = RewardPolicy(RewardPolicyConfig.model_validate(policy) if policy is not None else None)
    store = make_sample_store(redis, model_id=MODEL_ID, reward_policy=reward_policy)
    return store, RewardLedger(redis, store.line, reward_policy, owner=MODEL_ID)


def doc(sample_id: str, *, score: float = 0.6, source: str = "judge", created: float | None = None) -> dict[str, Any]:
    d = make_doc(sample_id, created=created or time.time() - 10)
    d["user_id"] = d["model"] = MODEL_ID
    d["judge"] = {"score": score, "source": source, "tag": "feedback"}
    return d


async def consistent(redis: Redis) -> dict[str, int]:
    """The invariants of the new state: every index member's hash has that status, counters equal index sizes,
    and the deadline index holds exactly the awaiting_rewards samples. Returns the index sizes."""
    sizes = {}
    for status in STATUSES:
        members = {m.decode() for m in await redis.zrange(keys.traj_index(MODEL_ID, status), 0, -1)}
        for member in members:
            assert (await redis.hget(keys.traj(member), "status")).decode() == status, member
        sizes[status] = len(members)
    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.traj_stats(MODEL_ID))).items()}
    assert {s: counters.get(f"status:{s}", 0) for s in STATUSES} == sizes
    deadlines = {m.decode() for m in await redis.zrange(keys.reward_deadlines(MODEL_ID), 0, -1)}
    awaiting = {m.decode() for m in await redis.zrange(keys.traj_index(MODEL_ID, "awaiting_rewards"), 0, -1)}
    assert deadlines == awaiting
    return sizes


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    config = make_config(redis_url, tmp_path, reward_policy=POLICY)
    async with running_app(config) as (app, client):
        yield app.state.deps, client


async def rewarded_terminal_sample(client: Any, t: str = "t1", c: str = "c1", reward: float = 0.6) -> None:
    await start_task(client, f"s-{t}", t)
    await capture(client, t, c, REQUEST, RESPONSE)
    await client.post(f"/v1/rl/tasks/{t}/stop")
    assert (await client.post(f"/v1/rl/tasks/{t}/reward", json={"reward": reward})).json() == {"sample_count": 1}


# ------------------------------------------------------------------------------------------------ over HTTP


async def test_terminal_sample_waits_then_becomes_pending_with_the_aggregate(service, redis):
    deps, client = service
    await rewarded_terminal_sample(client)
    assert (await client.get("/v1/rl/trajectories/c1")).json()["status"] == "awaiting_rewards"
    stats = (await client.get("/v1/rl/trajectories/stats")).json()
    assert stats["by_status"] == {"awaiting_rewards": 1, "pending": 0, "training": 0, "trained": 0, "failed": 0}
    assert stats["rewards"]["waiting"] == 1 and stats["rewards"]["next_deadline_at"] is not None
    listed = (await client.get("/v1/rl/trajectories", params={"status": "awaiting_rewards"})).json()
    assert [i["sample_id"] for i in listed["items"]] == ["c1"]

    r = await client.post("/v1/rl/trajectories/c1/rewards", json={"source": "business", "score": 1.0})
    assert r.status_code == 200
    assert (r.json()["recorded"], r.json()["status"], list(r.json()["rewards"]["waiting_for"])) == (
        True, "awaiting_rewards", ["human"])
    r = await client.post("/v1/rl/trajectories/c1/rewards", json={"source": "human", "score": 0.2})
    assert (r.json()["status"], r.json()["rewards"]["waiting_for"]) == ("pending", {})
    detail = (await client.get("/v1/rl/trajectories/c1")).json()
    assert detail["status"] == "pending"
    assert detail["judge"]["source"] == "terminal"
    assert detail["judge"]["score"] == pytest.approx((0.6 + 3.0 + 0.2) / 5)
    assert {n: s["kind"] for n, s in detail["rewards"]["sources"].items()} == {
        "terminal": "published", "business": "arrived", "human": "arrived"}
    # The trainer sees the aggregate too.
    (document,) = await deps.samples.documents.get_documents(["c1"])
    assert document["judge"]["score"] == pytest.approx(0.76)
    stats = (await client.get("/v1/rl/trajectories/stats")).json()
    assert (stats["by_status"]["awaiting_rewards"], stats["by_status"]["pending"]) == (0, 1)
    assert stats["rewards"]["sources"]["business"]["arrived"] == 1
    assert stats["rewards"]["sources"]["business"]["late_p50_seconds"] >= 0
    assert await consistent(redis) == {"awaiting_rewards": 0, "pending": 1, "training": 0, "trained": 0, "failed": 0,
                                           "evaluation": 0, "excluded": 0, "outdated": 0}


async def test_route_errors_idempotency_and_conflicts(service, redis):
    deps, client = service
    await rewarded_terminal_sample(client)
    url = "/v1/rl/trajectories/c1/rewards"
    first = await client.post(url, json={"source": "business", "score": 0.5})
    again = await client.post(url, json={"source": "business", "score": 0.5})
    assert (first.json()["recorded"], again.json()["recorded"]) == (True, False)
    assert again.json()["rewards"] == first.json()["rewards"]
    assert code(await client.post(url, json={"source": "business", "score": 0.7})) == (409, "reward_conflict")
    for bad in (True, None, "0.5", 1.5, -0.1):
        assert code(await client.post(url, json={"source": "human", "score": bad})) == (400, "invalid_reward")
    nan = await client.post(url, content=b'{"source": "human", "score": NaN}',
                            headers={"content-type": "application/json"})
    assert code(nan) == (400, "invalid_reward")
    for body in ({"score": 0.5}, {"source": "human", "score": 0.5, "x": 1}, {"source": 3, "score": 0.5}):
        assert code(await client.post(url, json=body)) == (400, "invalid_reward_request")
    assert code(await client.post(url, content=b"[1]")) == (400, "invalid_request")
    for source in ("judge", "terminal", "nobody"):
        assert code(await client.post(url, json={"source": source, "score": 0.5})) == (400, "invalid_reward_source")
    for missing in ("nope", "bad id!", "x" * 400):
        r = await client.post(f"/v1/rl/trajectories/{missing}/rewards", json={"source": "human", "score": 0.5})
        assert code(r) == (404, "trajectory_not_found")
    # Nothing of that changed the sample beyond the one business score.
    detail = (await client.get("/v1/rl/trajectories/c1")).json()
    assert (detail["status"], set(detail["rewards"]["sources"])) == ("awaiting_rewards", {"terminal", "business"})
    assert (await client.get("/v1/rl/trajectories/stats")).json()["rewards"]["sources"]["business"]["arrived"] == 1


async def test_refused_once_in_a_training_run_or_trained(service, redis):
    deps, client = service
    await deps.samples.publisher.insert_if_absent(packed(doc("a"), doc("b")))
    for sample_id in ("a", "b"):
        await deps.reward_ledger.attach(sample_id, "business", 1.0)
        await deps.reward_ledger.attach(sample_id, "human", 1.0)
    await move(redis, deps.samples.line, ["a", "b"], "training")
    await move(redis, deps.samples.line, ["b"], "trained")
    for sample_id, status in (("a", "training"), ("b", "trained")):
        r = await client.post(f"/v1/rl/trajectories/{sample_id}/rewards", json={"source": "business", "score": 1.0})
        assert code(r) == (409, "reward_conflict") and status in r.json()["error"]["message"]
    await consistent(redis)


async def test_batch_form_answers_each_item(service, redis):
    deps, client = service
    await deps.samples.publisher.insert_if_absent(packed(doc("a"), doc("b")))
    items = [
        {"trajectory_id": "a", "source": "business", "score": 1.0},
        {"trajectory_id": "a", "source": "human", "score": 0.0},
        {"trajectory_id": "b", "source": "business", "score": 0.5},
        {"trajectory_id": "b", "source": "business", "score": 0.9},
        {"trajectory_id": "zz", "source": "human", "score": 0.5},
        {"trajectory_id": "b", "source": "human", "score": 2},
        {"trajectory_id": "b", "source": "robot", "score": 0.5},
        {"trajectory_id": "b", "score": 0.5},
        "not an object",
    ]
    r = await client.post("/v1/rl/trajectories/rewards", json={"rewards": items})
    assert r.status_code == 200
    results = r.json()["results"]
    assert [x["ok"] for x in results] == [True, True, True, False, False, False, False, False, False]
    assert [x["error"]["code"] for x in results[3:]] == [
        "reward_conflict", "trajectory_not_found", "invalid_reward", "invalid_reward_source",
        "invalid_reward_request", "invalid_reward_request"]
    assert (results[1]["status"], results[2]["status"]) == ("pending", "awaiting_rewards")
    for body in ({}, {"rewards": []}, {"rewards": {}}, {"rewards": [{}] * 1001}, {"rewards": [], "x": 1}):
        assert code(await client.post("/v1/rl/trajectories/rewards", json=body)) == (400, "invalid_reward_request")
    await consistent(redis)


async def test_without_a_policy_nothing_changes_and_no_source_is_accepted(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (app, client):
        await rewarded_terminal_sample(client)
        stats = (await client.get("/v1/rl/trajectories/stats")).json()
        assert "rewards" not in stats and set(stats["by_status"]) == {"pending", "training", "trained", "failed"}
        detail = (await client.get("/v1/rl/trajectories/c1")).json()
        assert (detail["status"], detail["judge"], "rewards" in detail) == (
            "pending", {"score": 0.6, "source": "terminal"}, False)
        assert not await redis.hexists(keys.traj("c1"), "rewards")
        r = await client.post("/v1/rl/trajectories/c1/rewards", json={"source": "business", "score": 1.0})
        assert code(r) == (400, "invalid_reward_source")
        assert app.state.deps.reward_sweeper.running is False  # nothing waits, no policy: no background loop


async def test_background_sweeper_releases_at_the_deadline(redis, redis_url, tmp_path):
    policy = {"sources": {"business": {"deadline_seconds": 1, "fallback": "default", "default_score": 0.25}},
              "sweep_interval_seconds": 1.0}
    async with running_app(make_config(redis_url, tmp_path, reward_policy=policy)) as (app, client):
        assert app.state.deps.reward_sweeper.running
        await app.state.deps.samples.publisher.insert_if_absent(packed(doc("a", score=0.75)))
        # The sweeper learnt of the deadline only on its next wake (≤ interval): it sleeps until the earliest one.
        deadline = time.monotonic() + 8
        while (await client.get("/v1/rl/trajectories/a")).json()["status"] != "pending":
            assert time.monotonic() < deadline, "the sweeper did not release the sample"
            await asyncio.sleep(0.1)
        detail = (await client.get("/v1/rl/trajectories/a")).json()
        assert detail["judge"]["score"] == pytest.approx(0.5)
        assert detail["rewards"]["sources"]["business"]["kind"] == "default"
        assert (await client.get("/v1/rl/trajectories/stats")).json()["rewards"]["sources"]["business"] == {
            "arrived": 0, "fallback": 1, "late_p50_seconds": None, "late_p95_seconds": None}


# ------------------------------------------------------------------------------------------------ the store


async def test_deadlines_apply_each_fallback_and_drop(redis):
    policy = {"sources": {
        "business": {"weight": 3.0, "deadline_seconds": 3600, "fallback": "default", "default_score": 0.0},
        "human": {"deadline_seconds": 86400, "fallback": "skip"},
        "audit": {"deadline_seconds": 7200, "fallback": "drop"},
    }}
    store, ledger = make_store(redis, policy)
    await store.publisher.insert_if_absent(packed(doc("kept"), doc("dropped")))
    await ledger.attach("kept", "audit", 1.0)
    now = time.time()
    assert (await ledger.sweep_due(fence=UNFENCED, now=now + 3599)).visited == 0
    first = await ledger.sweep_due(fence=UNFENCED, now=now + 3601)  # business falls back to 0 on both
    assert (first.visited, first.released, first.fallbacks) == (2, 0, 2)
    second = await ledger.sweep_due(fence=UNFENCED, now=now + 7201)  # audit missing on one: dropped
    assert (second.visited, second.dropped) == (1, 1)
    assert not await redis.exists(keys.traj("dropped"))
    third = await ledger.sweep_due(fence=UNFENCED, now=now + 86401)  # human skipped: released
    assert (third.visited, third.released) == (1, 1)
    (kept,) = await store.documents.get_documents(["kept"])
    assert kept["judge"]["score"] == pytest.approx((0.6 + 0.0 * 3 + 1.0) / 5)
    assert {n: s["kind"] for n, s in kept["rewards"]["sources"].items()} == {
        "judge": "published", "audit": "arrived", "business": "default", "human": "skipped"}
    stats = await ledger.stats()
    assert stats["dropped"] == 1 and stats["waiting"] == 0
    assert {n: s["fallback"] for n, s in stats["sources"].items()} == {"business": 2, "human": 1, "audit": 1}
    assert (await store.stats.stats(store.line))["by_source"] == {"rl_task": 1}
    assert await consistent(redis) == {"awaiting_rewards": 0, "pending": 1, "training": 0, "trained": 0, "failed": 0,
                                           "evaluation": 0, "excluded": 0, "outdated": 0}


async def test_a_late_score_replaces_the_fallback_while_pending(redis):
    store, ledger = make_store(redis)
    await store.publisher.insert_if_absent(packed(doc("a", score=0.6)))
    await ledger.sweep_due(fence=UNFENCED, now=time.time() + 90000)
    assert (await store.documents.get_documents(["a"]))[0]["judge"]["score"] == pytest.approx(0.6 / 4)
    answer = await ledger.attach("a", "business", 1.0)
    assert (answer["status"], answer["recorded"]) == ("pending", True)
    assert (await store.documents.get_documents(["a"]))[0]["judge"]["score"] == pytest.approx(3.6 / 4)
    await consistent(redis)


async def test_the_run_claim_takes_only_pending(redis):
    store, ledger = make_store(redis)
    await store.publisher.insert_if_absent(packed(*(doc(f"w{i}") for i in range(3)), doc("r")))
    await ledger.attach("r", "business", 1.0)
    await ledger.attach("r", "human", 1.0)
    runs = RunClaims(redis, store.line, store.outdated, model_id=MODEL_ID, fence=UNFENCED)
    draft = TrainingRun(new_run_id(), "pending", "queued", 0, {}, now_iso())
    refused = await runs.claim(draft, parent_version=0, max_policy_lag=None, min_samples=2, max_samples=8)
    assert (refused.run, refused.eligible) == (None, 1)
    claimed = await runs.claim(draft, parent_version=0, max_policy_lag=None, min_samples=1, max_samples=8)
    assert claimed.run is not None and claimed.run.sample_ids == ["r"]
    await consistent(redis)


async def test_rollback_of_a_failed_publication_removes_waiting_samples(redis):
    store, ledger = make_store(redis)
    inserted = await store.publisher.insert_if_absent(packed(doc("a"), doc("b")))
    assert await store.deletion.delete_pending(inserted) == 2
    assert await consistent(redis) == dict.fromkeys(STATUSES, 0)
    assert await ledger.next_deadline() is None


async def test_concurrent_sweepers_move_each_sample_once(redis, redis_url):
    store, ledger = make_store(redis)
    await store.publisher.insert_if_absent(packed(*(doc(f"s{i}") for i in range(40))))
    other_redis = Redis.from_url(redis_url)
    try:
        _, other = make_store(other_redis)
        later = time.time() + 90000
        results = await asyncio.gather(ledger.sweep_due(fence=UNFENCED, now=later),
                                       other.sweep_due(fence=UNFENCED, now=later))
    finally:
        await other_redis.aclose()
    assert sum(r.released for r in results) == 40
    assert (await ledger.stats())["sources"]["business"]["fallback"] == 40
    assert (await ledger.stats())["sources"]["human"]["fallback"] == 40
    assert (await consistent(redis))["pending"] == 40


class CrashingRedis(Redis):
    """Dies right after its `survive`-th transaction reached Redis: the write is done, the process never sees it,
    and nothing after it is written."""

    survive = 0

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        if transaction:
            execute = pipe.execute

            async def dying_execute(*args: Any, **kwargs: Any) -> Any:
                if self.survive <= 0:
                    raise RedisConnectionError("simulated crash")
                result = await execute(*args, **kwargs)
                self.survive -= 1
                if self.survive == 0:
                    raise RedisConnectionError("simulated crash after EXEC")
                return result

            pipe.execute = dying_execute
        return pipe


async def test_restart_in_the_middle_of_a_deadline_sweep(redis, redis_url, tmp_path):
    policy = {"sources": {
        "business": {"deadline_seconds": 1, "fallback": "default", "default_score": 0.2},
        "audit": {"deadline_seconds": 1, "fallback": "drop"},
    }}
    store, ledger = make_store(redis, policy)
    await store.publisher.insert_if_absent(packed(*(doc(f"s{i:02d}") for i in range(30))))
    for i in range(0, 30, 2):  # half have their audit: they fall back on business and become pending
        await ledger.attach(f"s{i:02d}", "audit", 1.0)
    crashing = CrashingRedis.from_url(redis_url)
    crashing.survive = 11  # one EXEC per sample: s00..s10 move, then the process dies
    try:
        _, dying = make_store(crashing, policy)
        with pytest.raises(RedisConnectionError):
            await dying.sweep_due(fence=UNFENCED, now=time.time() + 2)
    finally:
        await crashing.aclose()
    # Every move so far was whole: 6 even samples pending, 5 odd ones dropped, 19 still waiting.
    assert await consistent(redis) == {"awaiting_rewards": 19, "pending": 6, "training": 0, "trained": 0, "failed": 0,
                                           "evaluation": 0, "excluded": 0, "outdated": 0}
    assert int(await redis.hget(keys.traj_stats(MODEL_ID), "reward_dropped")) == 5
    # Restart: the service's startup sweep finishes the job once the deadlines have passed in real time.
    while (next_at := await ledger.next_deadline()) is not None and next_at > time.time():
        await asyncio.sleep(next_at - time.time() + 0.01)
    async with running_app(make_config(redis_url, tmp_path, reward_policy=policy)) as (app, client):
        stats = (await client.get("/v1/rl/trajectories/stats")).json()
    assert stats["by_status"] == {"awaiting_rewards": 0, "pending": 15, "training": 0, "trained": 0, "failed": 0}
    assert stats["rewards"]["dropped"] == 15
    assert {n: s["fallback"] for n, s in stats["rewards"]["sources"].items()} == {"business": 30, "audit": 15}
    assert stats["by_source"] == {"rl_task": 15}
    await consistent(redis)


async def test_delayed_feedback_turns_wait_for_the_human_review(redis, redis_url, tmp_path):
    from tests.support.fake_judge import FakeJudge, Verdict
    from tests.support.service_app import with_user

    policy = {"aggregation": "last", "sources": {"human": {"deadline_seconds": 86400, "fallback": "skip"}}}
    async with FakeJudge() as judge:
        config = make_config(redis_url, tmp_path, judge_endpoint=judge.url, judge_model="judge", judge_retries=0,
                             judge_timeout=5.0, reward_policy=policy)
        async with running_app(config) as (_, client):
            await start_task(client, "s1", "t1", mode="delayed_feedback")
            await capture(client, "t1", "c1", REQUEST, RESPONSE, turn="u1")
            judge.enqueue(Verdict(9))
            await capture(client, "t1", "c2", with_user(REQUEST, "thanks"), RESPONSE, turn="u2")
            sample = (await client.get("/v1/rl/trajectories/c1")).json()
            assert (sample["status"], sample["judge"]["source"], sample["judge"]["score"]) == (
                "awaiting_rewards", "judge", 0.9)
            r = await client.post("/v1/rl/trajectories/c1/rewards", json={"source": "human", "score": 0.3})
            assert (r.json()["status"], r.json()["rewards"]["score"]) == ("pending", 0.3)
            sample = (await client.get("/v1/rl/trajectories/c1")).json()
            assert (sample["judge"]["score"], sample["judge"]["tag"]) == (0.3, "feedback")  # overridden, rest kept
            assert sample["rewards"]["sources"]["judge"] == {"score": 0.9, "kind": "published", "late_seconds": 0.0}
    await consistent(redis)


async def test_a_sample_published_before_the_policy_accepts_rewards(redis):
    plain, _ = make_store(redis, None)
    await plain.publisher.insert_if_absent(packed(doc("old", score=0.4, source="terminal")))
    assert not await redis.hexists(keys.traj("old"), "rewards")
    store, ledger = make_store(redis)
    answer = await ledger.attach("old", "business", 0.8)
    assert (answer["status"], answer["recorded"]) == ("pending", True)
    (document,) = await store.documents.get_documents(["old"])
    assert document["judge"]["score"] == pytest.approx((0.4 + 0.8 * 3) / 4)
    assert set(document["rewards"]["sources"]) == {"terminal", "business"}
    await consistent(redis)


async def test_samples_waiting_when_the_policy_is_removed_are_released(redis, redis_url, tmp_path):
    policy = {"sources": {"business": {"deadline_seconds": 1, "fallback": "drop"}}}
    store, _ = make_store(redis, policy)
    await store.publisher.insert_if_absent(packed(doc("a", score=0.7)))
    async with running_app(make_config(redis_url, tmp_path)) as (app, client):
        assert app.state.deps.reward_sweeper.running  # it runs while samples wait, policy or not
        stats = (await client.get("/v1/rl/trajectories/stats")).json()
        assert stats["by_status"]["awaiting_rewards"] == 1 and "rewards" not in stats
        # Its source is no longer part of any policy: at the deadline it is released, not dropped.
        deadline = time.monotonic() + 5
        while (await client.get("/v1/rl/trajectories/a")).json()["status"] != "pending":
            assert time.monotonic() < deadline, "the waiting sample was not released"
            await asyncio.sleep(0.05)
        detail = (await client.get("/v1/rl/trajectories/a")).json()
        assert detail["judge"]["score"] == 0.7 and detail["rewards"]["sources"] == {
            "judge": {"score": 0.7, "kind": "published", "late_seconds": 0.0}}
        assert set((await client.get("/v1/rl/trajectories/stats")).json()["by_status"]) == set(SAMPLE_STATUSES)
    await consistent(redis)


def _random_json(rng: Any, depth: int = 0) -> Any:
    choices = [None, True, False, 0, -1, 0.5, 1.5, 1e308, "", "human", "business", "judge", "c1", "x" * 300,
               "\u0000", "é", [], {}]
    if depth < 3 and rng.random() < 0.4:
        if rng.random() < 0.5:
            return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
        keys_ = ["source", "score", "trajectory_id", "rewards", "x"]
        return {rng.choice(keys_): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}
    return rng.choice(choices)


async def test_fuzzed_bodies_never_give_a_5xx(service, redis):
    import random

    deps, client = service
    await deps.samples.publisher.insert_if_absent(packed(doc("c1")))
    rng = random.Random(10)
    for i in range(300):
        body = _random_json(rng)
        if i % 3 == 0:
            body = {"source": rng.choice(["human", "business", "nope"]), "score": _random_json(rng)}
        path = rng.choice(["/v1/rl/trajectories/c1/rewards", "/v1/rl/trajectories/rewards",
                           "/v1/rl/trajectories/%2e%2e/rewards", "/v1/rl/trajectories/zz/rewards"])
        if path.endswith("/trajectories/rewards") and i % 2:
            body = {"rewards": [body] if not isinstance(body, list) else body}
        r = await client.post(path, content=orjson.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 404, 409), (path, body, r.status_code, r.text)
        if r.status_code != 200:
            error = r.json()["error"]
            assert set(error) == {"code", "message"} and isinstance(error["code"], str)
    await consistent(redis)
