"""The leader lease and the election of RL Service workers against a real Redis (CONTRACT §2.11, workers/).

Coordinators run in this process with recording duties; a paused Redis (SIGSTOP of a private redis-server) plays a
leader cut off from Redis: its duties must stop before the lease can go to anyone else.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from redis.asyncio import Redis

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.workers.coordinator import Placement, WorkerCoordinator
from openjiuwen.agent_evolving.agent_rl.online.workers.lease import Holder, LeaderLease, bury
from openjiuwen.agent_evolving.agent_rl.online.workers.membership import Membership
from tests.support.redis_server import RedisServer


class RecordingDuties:
    """What a coordinator asked of its service, with monotonic times."""

    def __init__(self, name: str, log: list[tuple[float, str, str]]) -> None:
        self.name, self.log = name, log
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
    duties = RecordingDuties(f"w{slot}", log)
    membership = Membership(redis, boot=boot, slot=slot, solo=count == 1)
    placement = Placement(boot=boot, index=slot, count=count, port=40000 + slot)
    return WorkerCoordinator(redis, placement, membership, duties, ttl_s=ttl_s, margin_s=margin_s,
                             beat_s=beat_s), duties


async def test_lease_has_one_holder_and_replaces_only_dead_ones(redis) -> None:
    a = LeaderLease(redis, Holder("b1", 0, 100, 1), ttl_s=5.0)
    b = LeaderLease(redis, Holder("b1", 1, 101, 2), ttl_s=5.0)
    assert await a.acquire() == 1
    assert await a.acquire() == 1  # the holder asking again keeps its term
    assert await b.acquire() == 0  # a live holder of this boot in another slot keeps it
    assert await b.renew() is False and await a.renew() is True
    assert (await b.current()) == Holder("b1", 0, 100, 1)
    await b.release()  # not the holder: nothing happens
    assert await redis.get(keys.LEADER) == b"b1:0:100:1"
    # Slot 0 restarted by its group (the old pid was reaped): the new process takes the lease at once.
    a2 = LeaderLease(redis, Holder("b1", 0, 200, 3), ttl_s=5.0)
    assert await a2.acquire() == 2
    assert await a.renew() is False  # the dead process's term is over
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
    for _ in range(60):
        if b.is_leader:
            break
        await asyncio.sleep(0.05)
    try:
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
                for _ in range(40):
                    if not a.is_leader:
                        break
                    await asyncio.sleep(0.05)
                deposed_at = time.monotonic()
                assert not a.is_leader
                # Deposed while the lease Redis holds was still valid (its TTL counts from the last renewal).
                assert deposed_at - paused_at < ttl_ms / 1000.0
                assert not b.is_leader  # nobody can acquire while Redis is stopped
            finally:
                server.resume()
            for _ in range(80):
                if a.is_leader or b.is_leader:
                    break
                await asyncio.sleep(0.05)
            assert a.is_leader or b.is_leader
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
