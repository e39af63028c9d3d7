"""The leader lease, the election of RL Service workers and the fence of the leader's writes against a real Redis
(CONTRACT §2.11, workers/).

Coordinators run in this process with recording duties; a paused Redis (SIGSTOP of a private redis-server) plays a
leader cut off from Redis: its duties must stop before the lease can go to anyone else. A blocked event loop plays
a leader stopped past its TTL: none of its queued writes may land once another worker holds the lease, and every
leader-only write of the duties is refused once its term is over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from openjiuwen.agent_evolving.agent_rl.common.ids import now_iso
from openjiuwen.agent_evolving.agent_rl.online.rewards.projector import RewardProjector
from openjiuwen.agent_evolving.agent_rl.online.retention import RetentionSweeper
from openjiuwen.agent_evolving.agent_rl.online.rollout.record import LoraRef, Rollout
from openjiuwen.agent_evolving.agent_rl.online.rollout.store import RolloutStore
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.assembly import make_sample_store
from openjiuwen.agent_evolving.agent_rl.online.training.run_records import RunStatus, TrainingRun, new_run_id
from openjiuwen.agent_evolving.agent_rl.online.store.sample_deletion import SampleDeletion
from openjiuwen.agent_evolving.agent_rl.online.training.run_claims import RunClaims
from openjiuwen.agent_evolving.agent_rl.online.training.run_transitions import RunTransitions
from openjiuwen.agent_evolving.agent_rl.online.training.scheduler import TrainingScheduler
from openjiuwen.agent_evolving.agent_rl.online.workers.coordinator import Placement, WorkerCoordinator, make_fence
from openjiuwen.agent_evolving.agent_rl.online.store.fence import (
    LUA_CHECK, UNFENCED, Fence, LeaseFence, LeaseLost, is_lease_lost,
)
from openjiuwen.agent_evolving.agent_rl.online.workers.lease import Holder, LeaderLease, bury
from openjiuwen.agent_evolving.agent_rl.online.workers.membership import Membership
from tests.integration.test_rewards import doc, make_store
from tests.integration.test_trajectory_store import move, packed
from tests.support.redis_server import RedisServer, free_port
from tests.support.waiting import wait_for_async
from tests.support.service_app import MODEL_ID, make_config, running_app, start_task


class RecordingDuties:
    """What a coordinator asked of its service, with monotonic times; `fence` is the one its writes would use."""

    def __init__(self, name: str, log: list[tuple[float, str, str]], fence: Fence) -> None:
        self.name, self.log, self.fence = name, log, fence
        self.follows = 0
        self.in_office = False

    async def take_office(self, *, first_of_boot: bool) -> None:
        self.log.append((time.monotonic(), self.name, "first" if first_of_boot else "takeover"))
        self.in_office = True

    async def leave_office(self, *, shutdown: bool) -> None:
        self.log.append((time.monotonic(), self.name, "shutdown" if shutdown else "deposed"))
        self.in_office = False

    async def follow(self) -> None:
        self.follows += 1


def coordinator(redis: Redis, slot: int, log: list, *, boot: str = "b1", count: int = 3, ttl_s: float = 1.0,
                margin_s: float = 0.4, beat_s: float = 0.1) -> tuple[WorkerCoordinator, RecordingDuties]:
    membership = Membership(redis, boot=boot, slot=slot, solo=count == 1)
    placement = Placement(boot=boot, index=slot, count=count, port=40000 + slot)
    duties = RecordingDuties(f"w{slot}", log, make_fence(placement))
    return WorkerCoordinator(redis, placement, membership, duties, duties.fence, ttl_s=ttl_s, margin_s=margin_s,
                             beat_s=beat_s), duties


def took_over(log: list[tuple[float, str, str]]) -> bool:
    """A new leader's duties have started. `is_leader` turns true a loop turn before: the office is its own task."""
    return any(what == "takeover" for _, _, what in log)


def term(lease: LeaderLease, epoch: int) -> LeaseFence:
    """The fence of `lease`'s holder, holding the term `epoch`."""
    fence = LeaseFence(lease.holder.value)
    fence.grant(epoch)
    return fence


async def test_lease_has_one_holder_and_replaces_only_dead_ones(redis) -> None:
    a = LeaderLease(redis, Holder("b1", 0, 100, 1), ttl_s=5.0)
    b = LeaderLease(redis, Holder("b1", 1, 101, 2), ttl_s=5.0)
    assert await a.acquire() == 1
    assert await a.acquire() == 1  # the holder asking again keeps its term
    assert await b.acquire() == 0  # a live holder of this boot in another slot keeps it
    assert await b.renew(term(b, 1), None) is False and await a.renew(term(a, 1), None) is True
    assert (await b.current()) == Holder("b1", 0, 100, 1)
    await b.release()  # not the holder: nothing happens
    assert await redis.get(keys.LEADER) == b"b1:0:100:1"
    # Slot 0 restarted by its group (the old pid was reaped): the new process takes the lease at once.
    a2 = LeaderLease(redis, Holder("b1", 0, 200, 3), ttl_s=5.0)
    assert await a2.acquire() == 2
    assert await a.renew(term(a, 1), None) is False  # the dead process's term is over
    # A new boot of the service replaces a holder of the previous one without waiting for the TTL.
    c = LeaderLease(redis, Holder("b2", 2, 300, 4), ttl_s=5.0)
    assert await c.acquire() == 3
    await c.release()
    assert await redis.get(keys.LEADER) is None
    assert await b.acquire() == 4  # released: anyone may take it, a new term
    assert 0 < await redis.pttl(keys.LEADER) <= 5000


async def test_one_of_three_workers_recovers_the_boot_the_others_wait_and_follow(redis) -> None:
    log: list[tuple[float, str, str]] = []
    pairs = [coordinator(redis, slot, log) for slot in range(3)]
    await asyncio.gather(*(c.start() for c, _ in pairs))
    try:
        leaders = [c for c, _ in pairs if c.is_leader]
        assert len(leaders) == 1
        assert [e[2] for e in log] == ["first"]
        assert await redis.get(keys.SERVICE_BOOT) == b"b1"
        await asyncio.sleep(0.35)
        followers = [d for c, d in pairs if not c.is_leader]
        assert all(d.follows >= 1 for d in followers)
        snapshot = leaders[0].snapshot()
        assert snapshot["leader"] is True and snapshot["live"] == 3 and snapshot["leader_epoch"] == 1
        # Membership: each sees the others alive, never itself.
        m0 = pairs[0][0].membership
        assert await m0.alive(pairs[1][0].member) and not await m0.alive(m0.member)
        assert not await m0.alive("b0:1:1")  # another boot
    finally:
        await asyncio.gather(*(c.stop() for c, _ in pairs))
    assert [e[2] for e in log][-1] == "shutdown"
    assert await redis.zcard(keys.WORKERS) == 0 and await redis.get(keys.LEADER) is None


async def test_a_leader_that_stops_renewing_hands_over_after_its_duties_stopped(redis) -> None:
    log: list[tuple[float, str, str]] = []
    (a, _), (b, _) = coordinator(redis, 0, log, count=2), coordinator(redis, 1, log, count=2)
    await a.start()
    await b.start()
    assert a.is_leader and not b.is_leader
    # The leader hangs: its heartbeat stops, nothing releases the lease. Its fence timer must depose it.
    assert a._beat is not None
    a._beat.cancel()
    began = time.monotonic()
    try:
        await wait_for_async(lambda: b.is_leader and took_over(log), timeout_s=3, what="w1 taking over")
        assert b.is_leader and not a.is_leader
        events = [(who, what) for _, who, what in log]
        assert events == [("w0", "first"), ("w0", "deposed"), ("w1", "takeover")]
        deposed_at = next(t for t, who, what in log if what == "deposed")
        took_at = next(t for t, who, what in log if what == "takeover")
        assert deposed_at < took_at
        assert deposed_at - began < 1.0 - 0.4 + 0.1  # within TTL − margin of the last renewal
        assert b.epoch == 2
    finally:
        await a.stop()
        await b.stop()


async def test_a_leader_cut_off_from_redis_stops_its_duties_before_the_lease_expires(tmp_path: Path) -> None:
    """Redis SIGSTOPped: no renewal can arrive. The leader's fence fires at TTL − margin after its last renewal was
    sent; the lease in Redis lasts the TTL after it was received. After the pause another worker takes over."""
    with RedisServer(tmp_path / "redis") as server:
        log: list[tuple[float, str, str]] = []
        ra, rb = Redis.from_url(server.url), Redis.from_url(server.url)
        (a, _), (b, _) = coordinator(ra, 0, log, count=2), coordinator(rb, 1, log, count=2)
        try:
            await a.start()
            await b.start()
            assert a.is_leader
            ttl_ms = await ra.pttl(keys.LEADER)
            server.pause()
            paused_at = time.monotonic()
            try:
                await wait_for_async(lambda: not a.is_leader, timeout_s=2, what="w0 deposed")
                deposed_at = time.monotonic()
                # Deposed while the lease Redis holds was still valid (its TTL counts from the last renewal).
                assert deposed_at - paused_at < ttl_ms / 1000.0
                assert not b.is_leader  # nobody can acquire while Redis is stopped
            finally:
                server.resume()
            await wait_for_async(lambda: (a.is_leader or b.is_leader) and took_over(log), timeout_s=4,
                                 what="a leader taking over after the pause")
            kinds = [what for _, _, what in log]
            assert kinds[:3] == ["first", "deposed", "takeover"]
        finally:
            await a.stop()
            await b.stop()
            await ra.aclose()
            await rb.aclose()


async def test_a_restarted_slot_forgets_its_dead_predecessor(redis) -> None:
    await redis.zadd(keys.WORKERS, {"b1:0:11": time.time() * 1000 + 60_000, "b1:1:12": time.time() * 1000 + 60_000})
    m = Membership(redis, boot="b1", slot=0, solo=False)
    assert await m.alive("b1:0:11")
    await m.forget_predecessors()
    assert not await m.alive("b1:0:11")  # slot 0's old process is dead: the group restarted the slot
    assert await m.alive("b1:1:12")
    assert not await Membership(redis).alive("b1:1:12")  # alone, nobody else is alive


async def test_a_reaped_worker_is_buried_at_once_its_lease_too(redis) -> None:
    now_ms = time.time() * 1000
    await redis.zadd(keys.WORKERS, {"b1:0:11": now_ms + 60_000, "b1:1:12": now_ms + 60_000})
    a = LeaderLease(redis, Holder("b1", 0, 11, 5), ttl_s=5.0)
    assert await a.acquire() == 1
    assert await bury(redis, "b1:1:12") is False  # not the holder: only its heartbeat goes
    assert await redis.get(keys.LEADER) == b"b1:0:11:5"
    assert await bury(redis, "b1:0:1") is False  # a pid that is a prefix of the holder's is another process
    assert await redis.get(keys.LEADER) == b"b1:0:11:5"
    assert await bury(redis, "b1:0:11") is True
    assert await redis.get(keys.LEADER) is None and await redis.zcard(keys.WORKERS) == 0
    b = LeaderLease(redis, Holder("b1", 2, 13, 6), ttl_s=5.0)
    assert await b.acquire() == 2  # the next leader is elected without waiting out the TTL


# ------------------------------------------------------------------------------------------ the fencing token

OTHER = Holder("b1", 1, 101, 2)


async def take_over(redis: Redis) -> int:
    """Another worker wins the lease once the current holder's TTL passed (its key is gone): the next term."""
    await redis.delete(keys.LEADER)
    return await LeaderLease(redis, OTHER, ttl_s=5.0).acquire()


async def stale_term(redis: Redis) -> LeaseFence:
    """The fence of a leader whose term (epoch 1) is over: its lease lapsed and another worker won term 2."""
    old = LeaderLease(redis, Holder("b1", 0, 100, 1), ttl_s=5.0)
    assert await old.acquire() == 1
    fence = term(old, 1)
    assert await take_over(redis) == 2
    return fence


async def test_a_fenced_write_lands_in_its_term_and_is_refused_once_another_began(redis) -> None:
    lease = LeaderLease(redis, Holder("b1", 0, 100, 1), ttl_s=5.0)
    assert await lease.acquire() == 1
    fence = term(lease, 1)
    assert await fence.write(redis, lambda pipe: pipe.set(keys.POLICY_OBSERVED, "term 1")) == [True]
    assert await take_over(redis) == 2
    with pytest.raises(LeaseLost, match="term 1 is over"):
        await fence.write(redis, lambda pipe: pipe.set(keys.POLICY_OBSERVED, "late"))
    assert await redis.get(keys.POLICY_OBSERVED) == b"term 1"
    # Refused once, the term is over here too: the next write fails without a round trip (this client has no
    # server to reach).
    assert fence.epoch is None
    nowhere = Redis(host="127.0.0.1", port=free_port())
    try:
        with pytest.raises(LeaseLost, match="holds no leader term"):
            await fence.write(nowhere, lambda pipe: pipe.set(keys.POLICY_OBSERVED, "later"))
    finally:
        await nowhere.aclose()


async def test_a_lapsed_lease_refuses_writes_before_anyone_takes_over(redis) -> None:
    lease = LeaderLease(redis, Holder("b1", 0, 100, 1), ttl_s=5.0)
    assert await lease.acquire() == 1
    fence = term(lease, 1)
    await redis.delete(keys.LEADER)  # its TTL passed; the epoch is still 1
    with pytest.raises(LeaseLost):
        await fence.transact(redis, lambda pipe: pipe.get(keys.POLICY_OBSERVED))


async def test_a_takeover_between_the_check_and_the_exec_fails_the_exec_and_the_retry_refuses(redis) -> None:
    """The leader stops after its transaction read the lease (the check passed) and before its EXEC; another
    worker takes over meanwhile. The EXEC fails its WATCH of the epoch; the retry finds the term over."""
    lease = LeaderLease(redis, Holder("b1", 0, 100, 1), ttl_s=5.0)
    assert await lease.acquire() == 1
    fence = term(lease, 1)
    bodies = 0

    async def body(pipe) -> list:
        nonlocal bodies
        bodies += 1
        await pipe.get(keys.POLICY_OBSERVED)
        if bodies == 1:
            assert await take_over(redis) == 2  # another connection: the pipeline's WATCH sees it
        pipe.multi()
        pipe.set(keys.POLICY_OBSERVED, "late")
        return await pipe.execute()

    with pytest.raises(LeaseLost, match="lease holds term 2"):
        await fence.transact(redis, body)
    assert bodies == 1 and await redis.get(keys.POLICY_OBSERVED) is None


async def test_leader_only_scripts_refuse_with_a_distinct_reply_and_the_fault_follows_the_term(redis) -> None:
    a = LeaderLease(redis, Holder("b1", 0, 100, 1), ttl_s=5.0)
    assert await a.acquire() == 1
    mine = term(a, 1)
    assert await a.renew(mine, "trainer unhealthy") is True
    assert await redis.get(keys.LEADER_FAULT) == b"trainer unhealthy"
    assert await a.renew(mine, None) is True and not await redis.exists(keys.LEADER_FAULT)
    # A script that starts with LUA_CHECK answers LEASE_LOST (not a result) for any token but the current one.
    script = LUA_CHECK + "return redis.call('SET', KEYS[3], ARGV[3])"
    lease_keys, lease_args = mine.script_args()
    assert await redis.eval(script, 3, *lease_keys, keys.POLICY_OBSERVED, *lease_args, "in term") == b"OK"
    assert await take_over(redis) == 2
    with pytest.raises(ResponseError) as refused:
        await redis.eval(script, 3, *lease_keys, keys.POLICY_OBSERVED, *lease_args, "late")
    assert is_lease_lost(refused.value)
    assert await redis.get(keys.POLICY_OBSERVED) == b"in term"
    # The deposed leader's renewal can neither extend the new term nor publish its fault over the new leader's.
    b = LeaderLease(redis, OTHER, ttl_s=5.0)
    assert await b.renew(term(b, 2), "the new leader's fault") is True
    assert await a.renew(mine, "a stale fault") is False
    assert await redis.get(keys.LEADER_FAULT) == b"the new leader's fault"
    assert await redis.get(keys.LEADER) == OTHER.value.encode()


async def test_a_leader_frozen_past_its_ttl_lands_none_of_its_queued_writes(redis, redis_url) -> None:
    """The SIGSTOP of docs/reliability.md inside one process: the event loop is blocked past the TTL (no timer, no
    renewal runs) while a duty write is queued, and another worker — a thread with its own loop and client — takes
    the lease meanwhile. Resumed, the queued write is refused by Redis; the frozen leader deposes itself."""
    log: list[tuple[float, str, str]] = []
    (a, duties), (b, _) = coordinator(redis, 0, log, count=2), coordinator(redis, 1, log, count=2)
    await a.start()
    await b.start()
    try:
        assert a.is_leader and a.epoch == 1
        queued = asyncio.create_task(duties.fence.write(redis, lambda pipe: pipe.set(keys.POLICY_OBSERVED, "a")))

        async def other_worker() -> int:
            r = Redis.from_url(redis_url)
            try:
                while await r.exists(keys.LEADER):  # the frozen leader's lease runs out: it renews nothing
                    await asyncio.sleep(0.05)
                return await LeaderLease(r, b.holder, ttl_s=1.0).acquire()
            finally:
                await r.aclose()

        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(asyncio.run, other_worker()).result(timeout=10) == 2  # blocks this loop throughout
        with pytest.raises(LeaseLost, match="lease holds term 2"):  # Redis refused it, not the overdue timer
            await queued
        assert await redis.get(keys.POLICY_OBSERVED) is None
        await wait_for_async(lambda: b.is_leader and not a.is_leader and took_over(log), timeout_s=3,
                             what="w1 taking over from the frozen w0")
        assert b.is_leader and b.epoch == 2 and not a.is_leader
        assert [(who, what) for _, who, what in log] == [("w0", "first"), ("w0", "deposed"), ("w1", "takeover")]
    finally:
        await a.stop()
        await b.stop()


async def test_stop_ends_a_heartbeat_that_swallowed_its_cancellation(redis) -> None:
    """A cancellation can be eaten by a call in flight (seen after a stall past the TTL: the worker's stop hung,
    its heartbeat beat on). Stop cancels again until the heartbeat is done."""
    (a, _) = coordinator(redis, 0, [], count=2)
    await a.start()
    entered, swallowed = asyncio.Event(), []
    beat_once = a._beat_once

    async def swallowing(loop) -> None:
        await beat_once(loop)
        entered.set()
        try:
            await asyncio.sleep(0.15)  # inside the beat's own timeout (2 × beat_s)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append("once")  # eaten, as a client may

    a._beat_once = swallowing  # type: ignore[method-assign]
    await entered.wait()
    stopping = asyncio.create_task(a.stop())
    done, _ = await asyncio.wait({stopping}, timeout=5)  # not wait_for: its cancel would end the heartbeat itself
    if not done:
        beat = a._beat
        assert beat is not None
        beat.cancel()  # let the hung stop finish before the test fails
        await stopping
    assert done and swallowed == ["once"]
    assert await redis.get(keys.LEADER) is None  # it went on to release the lease


async def test_a_first_leader_deposed_while_recovering_does_not_fail_the_start(redis) -> None:
    """Startup recovery refused half way (LeaseLost) is no failed start: the worker gives the duties up, a leader
    recovers the boot, and every worker becomes ready."""
    log: list[tuple[float, str, str]] = []
    pairs = [coordinator(redis, slot, log, count=2) for slot in range(2)]
    refusals = []

    def refuse_once(duties: RecordingDuties) -> None:
        take_office = duties.take_office

        async def refused(*, first_of_boot: bool) -> None:
            if not refusals:
                refusals.append(duties.name)
                raise LeaseLost("leader term 1 is over")
            await take_office(first_of_boot=first_of_boot)

        duties.take_office = refused  # type: ignore[method-assign]

    for _, duties in pairs:
        refuse_once(duties)
    await asyncio.wait_for(asyncio.gather(*(c.start() for c, _ in pairs)), 15)
    try:
        assert len(refusals) == 1
        assert await redis.get(keys.SERVICE_BOOT) == b"b1"
        assert [what for _, _, what in log].count("first") == 1  # recovered once, after the refusal
        assert sum(c.is_leader for c, _ in pairs) == 1
    finally:
        await asyncio.gather(*(c.stop() for c, _ in pairs))


# ------------------------------------------------------------------------------------ every leader-only write

T_OLD = time.time() - 7200
Write = Callable[[Fence], Awaitable[object]]


@dataclass
class Setup:
    redis_url: str
    stack: AsyncExitStack
    tmp: Path


async def duty_state(redis: Redis) -> dict[bytes, tuple[bytes, bool]]:
    """Every key a duty may write — all of `rl:v1:` but the workers' own `rl:v1:service:*` — with its DUMP and
    whether it has a TTL."""
    out = {}
    async for key in redis.scan_iter(match="rl:v1:*", count=1000):
        if not key.startswith(b"rl:v1:service:"):
            out[key] = (await redis.dump(key), await redis.pttl(key) > 0)
    return out


def run_claims(redis: Redis, fence: Fence) -> RunClaims:
    store = make_sample_store(redis, model_id=MODEL_ID)
    return RunClaims(redis, store.line, store.outdated, model_id=MODEL_ID, fence=fence)


def run_transitions(redis: Redis, fence: Fence) -> RunTransitions:
    return RunTransitions(redis, make_sample_store(redis, model_id=MODEL_ID).line, model_id=MODEL_ID,
                          run_retention_s=60, fence=fence)


def retention(redis: Redis, fence: Fence) -> RetentionSweeper:
    store = make_sample_store(redis, model_id=MODEL_ID)
    return RetentionSweeper(redis, store.line, store.deletion, RewardProjector(redis, store.publisher), fence=fence,
                            owner=MODEL_ID, task_retention_s=60, reward_timeout_s=60, trajectory_retention_s=60,
                            run_retention_s=60, interval_s=60)


async def pending_samples(redis: Redis, count: int = 2) -> list[str]:
    store, _ = make_store(redis, policy=None)
    ids = [f"s{i}" for i in range(count)]
    await store.publisher.insert_if_absent(packed(*(doc(i) for i in ids)))
    return ids


async def active_run(redis: Redis) -> TrainingRun:
    await pending_samples(redis)
    draft = TrainingRun(new_run_id(), "pending", "queued", 0, {}, now_iso())
    claim = await run_claims(redis, UNFENCED).claim(draft, parent_version=0, max_policy_lag=None, min_samples=1,
                                                    max_samples=8)
    assert claim.run is not None
    return claim.run


async def case_run_claim(redis: Redis, _: Setup) -> Write:
    await pending_samples(redis)
    draft = TrainingRun(new_run_id(), "pending", "queued", 0, {}, now_iso())
    return lambda fence: run_claims(redis, fence).claim(draft, parent_version=0, max_policy_lag=None,
                                                        min_samples=1, max_samples=8)


async def case_run_progress(redis: Redis, _: Setup) -> Write:
    run_id = (await active_run(redis)).training_run_id
    return lambda fence: run_transitions(redis, fence).update(run_id, lambda r: r.evolve(stage="training"),
                                                              event=("ppo_step", {"step": 1}))


async def case_run_trained(redis: Redis, _: Setup) -> Write:
    run_id = (await active_run(redis)).training_run_id
    await run_transitions(redis, UNFENCED).update(run_id, lambda r: r.evolve(status="running", stage="training"))
    return lambda fence: run_transitions(redis, fence).mark_trained(
        run_id, lora_name=f"{MODEL_ID}:v1", lora_path="/l/v1", dropped_ids=[], metrics_patch={})


async def case_run_finish(redis: Redis, _: Setup) -> Write:
    run_id = (await active_run(redis)).training_run_id
    return lambda fence: run_transitions(redis, fence).finish(
        run_id, RunStatus.FAILED, failure_reason="service_restarted", restore_samples=True)


async def case_run_abandon(redis: Redis, _: Setup) -> Write:
    run = await active_run(redis)
    await redis.delete(keys.training_run(run.training_run_id))  # the record vanished
    return lambda fence: run_transitions(redis, fence).abandon(run)


async def case_run_event(redis: Redis, _: Setup) -> Write:
    run_id = (await active_run(redis)).training_run_id
    return lambda fence: run_transitions(redis, fence).append_event(run_id, "recovered", {"stage": "training"})


async def case_observed_policy(redis: Redis, _: Setup) -> Write:
    return lambda fence: run_transitions(redis, fence).observe_policy(f"{MODEL_ID}:v1", "/l/v1")


def canary(rollout_id: str) -> Rollout:
    return Rollout(rollout_id=rollout_id, kind="canary", status="running", created_at=now_iso(),
                   candidate=LoraRef(f"{MODEL_ID}:v2"), baseline=LoraRef(f"{MODEL_ID}:v1"))


async def case_rollout_create(redis: Redis, _: Setup) -> Write:
    return lambda fence: RolloutStore(redis, fence=fence).create(canary("ro-000000000001"), "canary_started", {})


async def case_rollout_update(redis: Redis, _: Setup) -> Write:
    await RolloutStore(redis, fence=UNFENCED).create(canary("ro-000000000002"), "canary_started", {})
    return lambda fence: RolloutStore(redis, fence=fence).update(
        "ro-000000000002", lambda r: r.evolve(status="paused"), "paused", {})


async def case_retention_unrewarded(redis: Redis, _: Setup) -> Write:
    await redis.zadd(keys.TASKS_AWAITING_REWARD, {"t-late": T_OLD})
    await redis.sadd(keys.committed_captures("t-late"), "c1")
    await redis.set(keys.staged("t-late", "c1"), b"staged")
    return lambda fence: retention(redis, fence).sweep_once()


async def case_retention_rewarded(redis: Redis, _: Setup) -> Write:
    await redis.zadd(keys.TASKS_AWAITING_REWARD, {"t-done": T_OLD})
    await redis.set(keys.reward("t-done"), orjson.dumps({"reward": 1.0, "status": "published", "sample_count": 1}))
    return lambda fence: retention(redis, fence).sweep_once()


async def case_retention_terminal_tasks(redis: Redis, _: Setup) -> Write:
    await redis.zadd(keys.TASKS_GC, {"t-gc": T_OLD})
    await redis.set(keys.task("t-gc"), b"{}")
    return lambda fence: retention(redis, fence).sweep_once()


async def case_retention_samples(redis: Redis, _: Setup) -> Write:
    store, _ = make_store(redis, policy=None)
    ids = await pending_samples(redis)
    await move(redis, store.line, ids, "training")
    await move(redis, store.line, ids, "trained", at=T_OLD)
    return lambda fence: retention(redis, fence).sweep_once()


async def case_retention_listings(redis: Redis, _: Setup) -> Write:
    await redis.zadd(keys.TASKS_LISTING_EXPIRY, {"t-expired": T_OLD})
    await redis.zadd(keys.TASKS_BY_CREATION, {"t-expired": T_OLD})
    return lambda fence: retention(redis, fence).sweep_once()


async def case_reward_deadlines(redis: Redis, _: Setup) -> Write:
    store, ledger = make_store(redis)
    await store.publisher.insert_if_absent(packed(doc("w1")))
    return lambda fence: ledger.sweep_due(fence=fence, now=time.time() + 90000)


async def case_reward_due_hint_refresh(redis: Redis, _: Setup) -> Write:
    """A lineage line in the due-line hint whose deadlines moved on (its set is empty): the sweep resets the hint."""
    _, ledger = make_store(redis)
    await redis.zadd(keys.REWARD_DUE_LINES, {f"{MODEL_ID}:a": T_OLD})
    return lambda fence: ledger.sweep_due(fence=fence, now=time.time())


async def case_reward_due_hint_malformed(redis: Redis, _: Setup) -> Write:
    """A due-line hint entry no line of ours can carry: the sweep removes it."""
    _, ledger = make_store(redis)
    await redis.zadd(keys.REWARD_DUE_LINES, {"Not A Line!": T_OLD})
    return lambda fence: ledger.sweep_due(fence=fence, now=time.time())


async def case_startup_recovery(redis: Redis, setup: Setup) -> Write:
    app, client = await setup.stack.enter_async_context(running_app(make_config(setup.redis_url, setup.tmp)))
    assert (await start_task(client, "s-active", "t-active")).status_code == 201
    await redis.sadd(keys.ACTIVE_TASKS, "t-gone")  # a stale index entry: no record
    lifecycle = app.state.deps.lifecycle
    return lambda fence: lifecycle.recover(fence=fence)


@pytest.mark.parametrize("case", [
    case_run_claim, case_run_progress, case_run_trained, case_run_finish, case_run_abandon, case_run_event,
    case_observed_policy, case_rollout_create, case_rollout_update, case_retention_unrewarded,
    case_retention_rewarded, case_retention_terminal_tasks, case_retention_samples, case_retention_listings,
    case_reward_deadlines, case_reward_due_hint_refresh, case_reward_due_hint_malformed, case_startup_recovery,
], ids=lambda case: case.__name__.removeprefix("case_"))
async def test_every_leader_only_write_is_refused_once_its_term_is_over(redis, redis_url, tmp_path, case) -> None:
    """Each duty's write, made with the fence of a term that is over, raises LeaseLost and changes nothing; the
    same call unfenced does change the state (so the refusal was not for want of work)."""
    async with AsyncExitStack() as stack:
        write = await case(redis, Setup(redis_url, stack, tmp_path))
        stale = await stale_term(redis)
        before = await duty_state(redis)
        with pytest.raises(LeaseLost):
            await write(stale)
        assert await duty_state(redis) == before
        await write(UNFENCED)
        assert await duty_state(redis) != before


# The leader's writers: each takes a fence it cannot leave out (no default), so a new call site is fenced or fails.
LEADER_WRITERS = ("RunClaims", "RunTransitions", "RolloutStore", "RetentionSweeper", "RewardDeadlineSweeper",
                  "RewardLedger.sweep_due", "SampleDeletion.sweep_expired", "TaskLifecycle.recover",
                  "TaskRegistry.drop_stale_active", "TrainingScheduler")
# Modules written only by the leader: no Redis write may bypass the fence (no `transact`, no write command on the
# client or on a pipeline of its own), but for the listed functions, which any worker runs.
LEADER_MODULES = {"training/run_claims.py": set(), "training/run_transitions.py": set(),
                  "training/run_reads.py": {"list_page"}, "rollout/store.py": set(), "retention.py": set(),
                  "rewards/sweeper.py": set(), "training/scheduler.py": set()}
# Leader-only functions of modules that any worker also writes from (scanned alone: the module may use `transact`).
LEADER_FUNCTIONS = {"rewards/ledger.py": {"sweep_due", "_sweep_line", "_expire_one", "_refresh_hint"}}
REDIS_WRITES = {"set", "setex", "delete", "unlink", "expire", "pexpire", "zadd", "zrem", "zremrangebyscore", "sadd",
                "srem", "hset", "hdel", "hincrby", "incr", "incrby", "xadd", "lpush", "rpush", "eval", "evalsha",
                "append", "rename", "persist"}


def test_every_leader_only_writer_goes_through_the_fence() -> None:
    import ast
    import inspect

    from openjiuwen.agent_evolving.agent_rl.online import retention as retention_mod
    from openjiuwen.agent_evolving.agent_rl.online.tasks.lifecycle import TaskLifecycle
    from openjiuwen.agent_evolving.agent_rl.online.rewards.ledger import RewardLedger
    from openjiuwen.agent_evolving.agent_rl.online.rewards.sweeper import RewardDeadlineSweeper
    from openjiuwen.agent_evolving.agent_rl.online.tasks.registry import TaskRegistry

    objects = {"RunClaims": RunClaims, "RunTransitions": RunTransitions, "RolloutStore": RolloutStore,
               "RetentionSweeper": RetentionSweeper, "RewardDeadlineSweeper": RewardDeadlineSweeper,
               "RewardLedger.sweep_due": RewardLedger.sweep_due,
               "SampleDeletion.sweep_expired": SampleDeletion.sweep_expired,
               "TaskLifecycle.recover": TaskLifecycle.recover,
               "TaskRegistry.drop_stale_active": TaskRegistry.drop_stale_active,
               "TrainingScheduler": TrainingScheduler}
    assert tuple(objects) == LEADER_WRITERS
    for name, obj in objects.items():
        fence = inspect.signature(obj).parameters.get("fence")
        assert fence is not None and fence.default is inspect.Parameter.empty, f"{name} must require a fence"

    root = Path(retention_mod.__file__).parent
    unfenced = [hit for module, allowed in LEADER_MODULES.items()
                for hit in unfenced_writes(module, (root / module).read_text(), allowed)]
    for module, only in LEADER_FUNCTIONS.items():
        source = (root / module).read_text()
        defined = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.AsyncFunctionDef)}
        assert only <= defined, f"{module} no longer defines {only - defined}: update LEADER_FUNCTIONS"
        unfenced += [hit for hit in unfenced_writes(module, source, set(), only=only) if "imports" not in hit]
    assert unfenced == []


def unfenced_writes(module: str, source: str, allowed: set[str], *, only: set[str] | None = None) -> list[str]:
    """Redis writes in `source` that bypass a fence: `transact` imported, a write command on the client, on the
    event log or on a pipeline the function opened itself (a fenced body's pipeline is its parameter), or a call of
    a script the module registered that does not pass `script_args()` (LUA_CHECK's token). `only`: scan just these
    functions."""
    import ast

    tree = ast.parse(source)
    hits = [f"{module}: imports transact" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and any(a.name == "transact" for a in node.names)]
    scripts = {target.attr for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
               and node.value.func.attr == "register_script"
               for target in node.targets if isinstance(target, ast.Attribute)}
    for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        if func.name in allowed or (only is not None and func.name not in only):
            continue
        for call in (c for c in ast.walk(func) if isinstance(c, ast.Call)):
            if (isinstance(call.func, ast.Attribute) and call.func.attr in scripts
                    and "script_args" not in ast.unparse(call)):
                hits.append(f"{module}:{call.lineno} {ast.unparse(call)[:60]}")
        own_pipes = {item.optional_vars.id for w in ast.walk(func) if isinstance(w, (ast.With, ast.AsyncWith))
                     for item in w.items if isinstance(item.optional_vars, ast.Name)}
        for call in (c for c in ast.walk(func) if isinstance(c, ast.Call)):
            f = call.func
            if isinstance(f, ast.Attribute) and f.attr in REDIS_WRITES and (
                    ast.unparse(f.value) in {"self._redis", "redis", "self._events"}
                    or ast.unparse(f.value).startswith(("EventLog(", "events.EventLog("))
                    or ast.unparse(f.value) in own_pipes):
                hits.append(f"{module}:{call.lineno} {ast.unparse(call)[:60]}")
    return hits


def test_the_writer_scan_finds_the_writes_that_bypassed_the_fence_before() -> None:
    """The scan above is no empty check: the leader modules as they were before the fence are full of hits."""
    before = {
        "retention.py": """
from .store.tx import transact
class S:
    async def _move_to_gc(self, t):
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zrem("a", t)
            pipe.zadd("b", {t: 1})
            await pipe.execute()
""",
        "training/run_transitions.py": """
class R:
    async def observe_policy(self, name, path):
        await self._redis.set("k", name)
    async def append_event(self, run_id, kind, data):
        await events.EventLog(self._redis).append("s", kind, data)
""",
        "training/run_reads.py": """
class R:
    async def list_page(self):
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zrem("runs", "gone")
""",
    }
    hits = [hit for module, source in before.items()
            for hit in unfenced_writes(module, source, LEADER_MODULES[module])]
    assert hits == ["retention.py: imports transact", "retention.py:6 pipe.zrem('a', t)",
                    "retention.py:7 pipe.zadd('b', {t: 1})",
                    "training/run_transitions.py:4 self._redis.set('k', name)",
                    "training/run_transitions.py:6 events.EventLog(self._redis).append('s', kind, data)"]
    # The reward sweeper's hint writes as they were before the fence (issue 27 review): a registered script called
    # without the term's token and a plain ZREM, found in the leader's functions only (`attach` is any worker's).
    ledger_before = """
class L:
    def __init__(self, redis):
        self._hint = redis.register_script("...")
    async def attach(self):
        await self._redis.zrem("mine", "x")
    async def sweep_due(self, fence, raw, line):
        await self._redis.zrem("due", raw)
        await self._hint(keys=[line], args=[])
        await self._hint(keys=[*fence.script_args()[0], line], args=[*fence.script_args()[1]])
"""
    assert sorted(unfenced_writes("rewards/ledger.py", ledger_before, set(), only={"sweep_due"})) == [
        "rewards/ledger.py:8 self._redis.zrem('due', raw)", "rewards/ledger.py:9 self._hint(keys=[line], args=[])"]


def test_a_leader_route_refused_by_the_fence_answers_503_service_not_ready() -> None:
    """A relayed leader-only route on a worker deposed meanwhile: the contract's failover answer, not a 500."""
    from openjiuwen.agent_evolving.agent_rl.common.errors import ApiError
    from openjiuwen.agent_evolving.agent_rl.online.api.errors import domain_errors

    with pytest.raises(ApiError) as answered:
        with domain_errors(not_found="training_run_not_found", conflict="insufficient_samples"):
            raise LeaseLost("leader term 1 is over")
    assert (answered.value.status, answered.value.code) == (503, "service_not_ready")


@pytest.mark.parametrize("writer", ["run_activation", "rollout_promotion"])
async def test_a_deposed_leader_never_rewrites_a_lineage_lines_active_marker(redis, redis_url, tmp_path,
                                                                              writer) -> None:
    """Issue 27 review item 3: a run's activation and a rollout's promotion of a non-default line wrote the line's
    repository `active` file with no fenced write before it, so a deposed leader resuming there rolled the marker
    back under its successor. Now the line's observed policy (`policy:observed_lines`, fenced) is written first, for
    every line: the stale term stops there and the file is never written. With a live term both land."""
    line = f"{MODEL_ID}:a"
    lora = {"lora_name": f"{line}:v1", "lora_path": str(tmp_path / "v1")}
    async with running_app(make_config(redis_url, tmp_path)) as (app, _):
        deps = app.state.deps
        runs = deps.runner._runs
        marker = deps.repository.for_line(line).model_dir / "active"
        run = TrainingRun(training_run_id=new_run_id(), status="running", stage="activating", sample_count=1,
                          policy_versions={}, created_at=now_iso(), lineage="a", **lora)

        async def write() -> None:
            if writer == "run_activation":
                await deps.runner._activation.succeed(run)
            else:
                await deps.rollout._changes.now_active("a", LoraRef(**lora), run.training_run_id)

        runs._fence = await stale_term(redis)
        with pytest.raises(LeaseLost):
            await write()
        assert not marker.exists()
        assert await redis.hget(keys.POLICY_OBSERVED_LINES, line) is None
        if writer == "rollout_promotion":  # (a run's activation also ends its record, which this run has not)
            runs._fence = UNFENCED
            await write()
            assert f"{line}:v1" in marker.read_text()
            assert orjson.loads(await redis.hget(keys.POLICY_OBSERVED_LINES, line))["lora_name"] == f"{line}:v1"
