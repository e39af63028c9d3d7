"""Rewards and retention per line (docs/lineages.md, issue 27) against a private real Redis: an external reward of
a lineage's sample moves it in its own line's indexes, the deadline sweeper and the retention sweeper reach the
samples of every registered line (through the due-line hint and the registry cursor), and
`reward_policy.lineages.<name>` gives a lineage its own sources."""

from __future__ import annotations

import time

import pytest

from openjiuwen.agent_evolving.agent_rl.online.store.fence import UNFENCED
from openjiuwen.agent_evolving.agent_rl.online.config import ConfigError
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.integration.test_lineage_training import publish
from tests.integration.test_rewards import POLICY
from tests.integration.test_trajectory_store import move
from tests.support.invariants import check_invariants
from tests.support.service_app import MODEL_ID, make_config, running_app

LINE_A = f"{MODEL_ID}:a"
THUMBS = {"aggregation": "min", "sources": {"terminal": {"weight": 1.0},
                                            "thumbs": {"deadline_seconds": 60, "fallback": "drop"}}}


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    config = make_config(redis_url, tmp_path, reward_policy={**POLICY, "lineages": {"b": THUMBS}})
    async with running_app(config) as (app, client):
        yield app.state.deps, client


async def members(redis, line: str, status: str) -> list[str]:
    return [m.decode() for m in await redis.zrange(keys.traj_index(line, status), 0, -1)]


async def counters(redis, line: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(keys.traj_stats(line))).items()}


async def clean(redis) -> None:
    report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
    # The samples were published without Task records (straight through the store); every other rule holds.
    assert [v for v in report.violations if "which has no record" not in v] == []


async def test_an_external_reward_moves_a_lineage_sample_in_its_own_line(service, redis):
    deps, client = service
    [sample_id] = await publish(deps.samples, "a", 1, start=0, score=0.5)
    assert await members(redis, LINE_A, "awaiting_rewards") == [sample_id]
    assert await redis.zrange(keys.reward_deadlines(LINE_A), 0, -1) == [sample_id.encode()]
    for source in ("business", "human"):
        r = await client.post(f"/v1/rl/trajectories/{sample_id}/rewards", json={"source": source, "score": 1.0})
        assert r.status_code == 200, r.text
    assert r.json()["status"] == "pending"
    assert await members(redis, LINE_A, "pending") == [sample_id]
    assert await members(redis, LINE_A, "awaiting_rewards") == []
    assert await redis.zcard(keys.reward_deadlines(LINE_A)) == 0
    # Nothing of it reached the default line's indexes or counters.
    assert await members(redis, MODEL_ID, "pending") == []
    assert (await counters(redis, MODEL_ID)).get("status:pending", 0) == 0
    line_counts = await counters(redis, LINE_A)
    assert (line_counts["status:pending"], line_counts["status:awaiting_rewards"]) == (1, 0)
    assert line_counts["reward_arrived:business"] == 1
    assert await redis.llen(keys.reward_latency(LINE_A, "business")) == 1
    await clean(redis)


async def test_the_deadline_sweeper_applies_fallbacks_to_lineage_samples(service, redis):
    deps, _ = service
    a_ids = await publish(deps.samples, "a", 2, start=0, score=0.5)
    [default_id] = await publish(deps.samples, "default", 1, start=5, score=0.5)
    # The line's hint is at (or below) its earliest deadline: business, an hour after publication.
    [(line, hint)] = await redis.zrange(keys.REWARD_DUE_LINES, 0, -1, withscores=True)
    assert line.decode() == LINE_A and hint <= time.time() + 3600
    assert await deps.reward_ledger.next_deadline() == pytest.approx(hint)

    # Past business's deadline, not human's: business falls back to 0, the samples keep waiting for human, and
    # the hint rises to human's deadline (a day after publication).
    result = await deps.reward_sweeper.sweep_once(now=time.time() + 3700)
    assert (result.visited, result.fallbacks, result.released) == (3, 3, 0)
    assert await members(redis, LINE_A, "awaiting_rewards") == a_ids
    assert await redis.zscore(keys.REWARD_DUE_LINES, LINE_A) > time.time() + 86000
    assert (await counters(redis, LINE_A))["reward_fallback:business"] == 2
    await clean(redis)

    # Past human's too: every sample is released on its own line; the line leaves the hint.
    result = await deps.reward_sweeper.sweep_once(now=time.time() + 90000)
    assert (result.visited, result.released) == (3, 3)
    assert await members(redis, LINE_A, "pending") == a_ids
    assert await members(redis, MODEL_ID, "pending") == [default_id]
    assert await redis.zcard(keys.REWARD_DUE_LINES) == 0
    assert await deps.reward_ledger.waiting() == 0
    await clean(redis)


async def test_a_busy_default_line_never_starves_the_due_lineage_lines(service, redis):
    """Issue 27 review item 4: the default line took the sweep's whole `limit` before any other line was read, so a
    default line with more due samples than `limit` at every tick starved every lineage. While lines are due, the
    default line now takes at most half of the limit first, the due lines the rest, the default line what they
    leave; with no line due it takes the whole limit as before."""
    deps, _ = service
    ledger = deps.reward_ledger
    past_business = time.time() + 3700

    def fallbacks(counts: dict[str, int]) -> int:
        return counts.get("reward_fallback:business", 0)

    await publish(deps.samples, "default", 6, start=0, score=0.5)
    a_ids = await publish(deps.samples, "a", 3, start=10, score=0.5)
    # Line a is due: 2 default samples (half of 4), then 2 of a's.
    assert (await ledger.sweep_due(fence=UNFENCED, now=past_business, limit=4)).visited == 4
    assert (fallbacks(await counters(redis, MODEL_ID)), fallbacks(await counters(redis, LINE_A))) == (2, 2)
    # Again: 2 default, a's last one, and the default line takes the share a left (1).
    assert (await ledger.sweep_due(fence=UNFENCED, now=past_business, limit=4)).visited == 4
    assert (fallbacks(await counters(redis, MODEL_ID)), fallbacks(await counters(redis, LINE_A))) == (5, 3)
    assert await redis.zscore(keys.REWARD_DUE_LINES, LINE_A) > past_business  # a's next: human, a day later
    # No line due: the default line's last one, the whole limit its own.
    await publish(deps.samples, "default", 4, start=20, score=0.5)
    assert (await ledger.sweep_due(fence=UNFENCED, now=past_business, limit=4)).visited == 4
    assert fallbacks(await counters(redis, MODEL_ID)) == 9
    assert await members(redis, LINE_A, "awaiting_rewards") == a_ids  # still waiting for human
    await clean(redis)


async def test_a_line_whose_hint_is_not_due_is_not_visited(service, redis):
    deps, _ = service
    await publish(deps.samples, "a", 1, start=0, score=0.5)
    # A line with a hint in the future: the sweeper does not read its set (so it does not apply a due deadline
    # placed there by hand, which a real publication would have lowered the hint for).
    await redis.zadd(keys.reward_deadlines(LINE_A), {"c0000": 1.0})
    await redis.zadd(keys.REWARD_DUE_LINES, {LINE_A: time.time() + 10_000})
    assert (await deps.reward_ledger.sweep_due(fence=UNFENCED, now=time.time())).visited == 0
    assert await members(redis, LINE_A, "awaiting_rewards") == ["c0000"]


async def test_a_lineage_follows_its_own_reward_policy(service, redis):
    deps, client = service
    [b_id] = await publish(deps.samples, "b", 1, start=0, score=0.5)
    [a_id] = await publish(deps.samples, "a", 1, start=1, score=0.5)
    # `b` waits for thumbs only (its override); `a` for the top-level business and human.
    detail = (await client.get(f"/v1/rl/trajectories/{b_id}")).json()
    assert (detail["status"], list(detail["rewards"]["waiting_for"])) == ("awaiting_rewards", ["thumbs"])
    r = await client.post(f"/v1/rl/trajectories/{b_id}/rewards", json={"source": "business", "score": 1.0})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_reward_source")
    r = await client.post(f"/v1/rl/trajectories/{a_id}/rewards", json={"source": "thumbs", "score": 1.0})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_reward_source")
    r = await client.post(f"/v1/rl/trajectories/{b_id}/rewards", json={"source": "thumbs", "score": 0.25})
    assert r.status_code == 200, r.text
    assert (r.json()["status"], r.json()["rewards"]["aggregation"], r.json()["rewards"]["score"]) == (
        "pending", "min", 0.25)
    assert await members(redis, f"{MODEL_ID}:b", "pending") == [b_id]
    # thumbs falls back to `drop` for b's samples: a second one is dropped at its deadline, on b's line.
    [b2] = await publish(deps.samples, "b", 1, start=2, score=0.5)
    result = await deps.reward_sweeper.sweep_once(now=time.time() + 120)
    assert result.dropped == 1 and await redis.exists(keys.traj(b2)) == 0
    assert (await counters(redis, f"{MODEL_ID}:b"))["reward_dropped"] == 1
    assert await members(redis, LINE_A, "awaiting_rewards") == [a_id]  # business (1 h) is not due yet
    await clean(redis)


async def test_retention_removes_old_samples_of_lineage_lines(service, redis):
    deps, _ = service
    a_ids = await publish(deps.samples, "a", 2, start=0, score=0.5)
    line = deps.samples.line.for_line(LINE_A)
    await deps.reward_sweeper.sweep_once(now=time.time() + 90000)  # every deadline passed: pending
    now = time.time()
    await move(redis, line, a_ids, "training", at=now)
    await move(redis, line, a_ids[:1], "trained", at=now)
    await move(redis, line, a_ids[1:], "failed", at=now)
    # Not yet old: kept. Then past trajectory_retention_seconds: removed from the line, counters following.
    assert (await deps.sweeper.sweep_once())["samples_removed"] == 0
    far = time.time() + 2 * 604800
    assert (await deps.sweeper.sweep_once(now=far))["samples_removed"] == 2
    assert [await redis.exists(keys.traj(s)) for s in a_ids] == [0, 0]
    assert await members(redis, LINE_A, "trained") == await members(redis, LINE_A, "failed") == []
    line_counts = await counters(redis, LINE_A)
    assert (line_counts["status:trained"], line_counts["status:failed"]) == (0, 0)
    await clean(redis)


@pytest.mark.parametrize("name", ["default", "Bad", "v3"])
def test_a_reward_policy_override_names_a_lineage_other_than_default(tmp_path, name):
    with pytest.raises(ConfigError):
        make_config("redis://127.0.0.1:1/0", tmp_path, reward_policy={**POLICY, "lineages": {name: THUMBS}})
