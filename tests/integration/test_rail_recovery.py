"""rail-v1 ingestion under faults (docs/reliability.md): a popped sample is deleted only once judged and stored, so a
crash after the pop or a failing store never loses it, and the client's retry pairs the feedback with it again."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from openjiuwen.agent_evolving.agent_rl.online.rail_ingest.ingest import RailIngestor
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.assembly import make_sample_store
from tests.integration.test_rail import MODEL, RETENTION_S, SESSION, TRAJ, FakeJudge, batch, rail_sample
from tests.support.invariants import check_invariants


def make(redis: Redis, judge: FakeJudge) -> RailIngestor:
    return RailIngestor(redis, make_sample_store(redis, model_id=MODEL).publisher, judge, model_id=MODEL,
                        retention_seconds=RETENTION_S)


async def staged(redis: Redis) -> list[str]:
    return [m.decode() for m in await redis.zrange(keys.pending_judge_session(SESSION), 0, -1)]


async def pending(redis: Redis) -> list[str]:
    return sorted(m.decode() for m in await redis.zrange(keys.traj_index(MODEL, "pending"), 0, -1))


async def nothing_in_flight(redis: Redis) -> bool:
    return not await redis.exists(keys.rail_inflight(SESSION), keys.RAIL_INFLIGHT_SESSIONS)


async def test_a_crash_after_the_pop_loses_nothing_and_the_retry_pairs_the_same_sample(redis: Redis) -> None:
    judge = FakeJudge()
    crashed = make(redis, judge)
    await crashed.ingest(batch(rail_sample(0), rail_sample(1)))
    popped = await crashed._pop(SESSION, first_only=True)  # the process dies before judging it
    assert [s.sample_id for s in popped] == [f"{TRAJ}:0"]
    assert await staged(redis) == [f"{TRAJ}:1"] and await redis.exists(keys.pending_judge(SESSION, TRAJ, 0)) == 1

    restarted = make(redis, judge)
    assert await restarted.recover() == 1
    assert await staged(redis) == [f"{TRAJ}:0", f"{TRAJ}:1"] and await nothing_in_flight(redis)
    result = await restarted.ingest(batch(prev_feedback={"text": "good"}))  # the uploader's retry
    assert (result["judged"], result["judge_failed"]) == (1, 0)
    assert judge.calls == [("reply 0", "good")]
    assert await pending(redis) == [f"{TRAJ}:0"] and await staged(redis) == [f"{TRAJ}:1"]
    assert await redis.exists(keys.pending_judge(SESSION, TRAJ, 0)) == 0 and await nothing_in_flight(redis)
    await check_invariants(redis, model_id=MODEL)


async def test_a_failing_store_puts_the_popped_samples_back_for_the_retry(redis: Redis, monkeypatch) -> None:
    judge = FakeJudge()
    ingestor = make(redis, judge)
    await ingestor.ingest(batch(rail_sample(0), rail_sample(1)))
    store = ingestor._samples
    real_insert = store.insert_if_absent

    async def broken(samples):
        raise RedisConnectionError("Redis went away")

    monkeypatch.setattr(store, "insert_if_absent", broken)
    with pytest.raises(RedisConnectionError):
        await ingestor.ingest(batch(session_done=True))
    assert await staged(redis) == [f"{TRAJ}:0", f"{TRAJ}:1"] and await nothing_in_flight(redis)
    assert await pending(redis) == []

    monkeypatch.setattr(store, "insert_if_absent", real_insert)
    result = await ingestor.ingest(batch(session_done=True))
    assert (result["judged"], result["session_flushed"]) == (2, 2)
    assert await pending(redis) == [f"{TRAJ}:0", f"{TRAJ}:1"] and await staged(redis) == []
    assert await redis.exists(*(keys.pending_judge(SESSION, TRAJ, n) for n in range(2))) == 0
    assert await nothing_in_flight(redis)
    await check_invariants(redis, model_id=MODEL)
