"""One worker's part in the group: its heartbeat, the leader election and the duties that go with the lease.

With one worker (`workers: 1`, or an app built in-process) the process is the leader for its whole life: it runs
startup recovery and then every duty, exactly as a lone service always did; no lease is taken and nothing beats.

With several, every worker beats every `beat_s` (two round trips): its membership (`keys.WORKERS`, scored
by the moment its entry expires), the live count, the boot mark, and the lease (renewal, or an acquisition try).
- The first worker of a boot to win the lease runs *startup recovery* (`take_office(first_of_boot=True)`) and then
  marks the boot recovered; the others wait for that mark before they serve, so nobody answers a hook while
  recovery still aborts the Tasks of the previous boot.
- A later winner (the leader died or lost Redis) runs the *takeover* recovery only (`first_of_boot=False`): the run
  and rollout the dead leader left, never a Task abort — the other workers kept serving those Tasks.
- Fencing by time: a leader counts its validity from the moment it *sent* its last successful renewal, plus the TTL
  minus `margin_s`; a timer deposes it (its duties stop) at that moment unless a renewal came first. Redis cannot
  hand the lease to anyone before the TTL has passed since it *received* that renewal, later still.
- Fencing token: the timer needs a running event loop. A leader stopped for longer than the TTL resumes with duty
  writes already queued, which run before the timer does; so every leader-only write goes through the term's fence
  (fence.py), and Redis refuses it once another term began. The coordinator grants the fence a term when it wins
  the lease and revokes it when it deposes itself; a refused write (`LeaseLost`) stops the duty that made it, and
  the next renewal, refused too, deposes the worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Protocol

from redis.asyncio import Redis

from ..store import keys
from ..store.fence import UNFENCED, Fence, LeaseFence, LeaseLost
from .lease import Holder, LeaderLease
from .membership import Membership

log = logging.getLogger("openjiuwen.agent_rl.online.workers")

LEASE_TTL_S = 5.0
LEASE_MARGIN_S = 2.0  # a leader's duties stop this long before its lease can expire in Redis
BEAT_S = 1.0  # heartbeats cost every worker two Redis round trips: one a second


class Duties(Protocol):
    async def take_office(self, *, first_of_boot: bool) -> None: ...

    async def leave_office(self, *, shutdown: bool) -> None: ...

    async def follow(self) -> None: ...


@dataclass(frozen=True)
class Placement:
    """Where this process stands in its group: the boot it belongs to, its slot, the group size and the private
    loopback port a follower forwards leader-only requests to."""

    boot: str = "solo"
    index: int = 0
    count: int = 1
    port: int = 0

    @property
    def solo(self) -> bool:
        return self.count == 1

    @property
    def holder(self) -> Holder:
        """This process as the lease names it."""
        return Holder(self.boot, self.index, os.getpid(), self.port)


def make_fence(placement: Placement) -> Fence:
    """The fence of this process's leader-only writes: none alone, this holder's lease in a group."""
    return UNFENCED if placement.solo else LeaseFence(placement.holder.value)


class WorkerCoordinator:
    def __init__(
        self, redis: Redis, placement: Placement, membership: Membership, duties: Duties, fence: Fence, *,
        ttl_s: float = LEASE_TTL_S, margin_s: float = LEASE_MARGIN_S, beat_s: float = BEAT_S,
        leader_check: Callable[[], Awaitable[None] | None] | None = None,
    ) -> None:
        if not 0 < margin_s < ttl_s:
            raise ValueError("the margin must be positive and below the TTL")
        self._redis = redis
        self.placement = placement
        self._duties = duties
        self._ttl_s, self._margin_s, self._beat_s = ttl_s, margin_s, beat_s
        self.membership = membership
        self.holder = placement.holder
        assert self.holder.member == membership.member
        if not placement.solo and not (isinstance(fence, LeaseFence) and fence.holder == self.holder.value):
            raise ValueError("a worker of a group writes its duties through the lease fence of its own holder")
        self._fence = fence
        self._lease = LeaderLease(redis, self.holder, ttl_s=ttl_s)
        self._leader_check = leader_check  # the leader's health (its Training Runner), published for followers
        self.is_leader = False
        self.epoch = 0
        self.live_workers = 1 if placement.solo else 0
        self._valid_until = 0.0
        self._ready: asyncio.Future[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._office: asyncio.Task[None] | None = None
        self._fence_timer: asyncio.TimerHandle | None = None
        self._deposing: asyncio.Task[None] | None = None
        self._last_warning = 0.0

    @property
    def member(self) -> str:
        return self.holder.member

    # ------------------------------------------------------------------ lifespan

    async def start(self) -> None:
        """Return once this worker may serve: recovery of this boot is done (by it or by the leader)."""
        if self.placement.solo:
            await self._duties.take_office(first_of_boot=True)
            self.is_leader = True
            return
        await self.membership.forget_predecessors()
        self._ready = asyncio.get_running_loop().create_future()
        self._beat = asyncio.create_task(self._run(), name="worker-heartbeat")
        await self._ready

    async def stop(self) -> None:
        """The whole service stops: the worker leaves the membership first (the leader waits for the others to be
        gone before it finishes the active Tasks), then the leader hands in its duties with the shutdown steps,
        renewing its lease meanwhile (those steps write through its fence too), and releases the lease."""
        if self._beat is not None:
            await _cancelled(self._beat, self._beat_s)
            self._beat = None
        if not self.placement.solo:
            with suppress(Exception):
                await self._redis.zrem(keys.WORKERS, self.member)
        if self.is_leader:
            keeper = None if self.placement.solo else asyncio.create_task(self._keep_lease(), name="leader-leaving")
            try:
                await self._depose(shutdown=True)
            finally:
                if keeper is not None:
                    await _cancelled(keeper, self._beat_s)
        if not self.placement.solo:
            with suppress(Exception):
                await self._lease.release()

    async def leader(self) -> Holder | None:
        """The current lease holder, as Redis says (None during a failover)."""
        if self.placement.solo:
            return self.holder
        return await self._lease.current()

    def snapshot(self) -> dict[str, Any]:
        return {"workers": self.placement.count, "live": self.live_workers, "worker": self.placement.index,
                "pid": self.holder.pid, "port": self.placement.port, "leader": self.is_leader,
                "leader_epoch": self.epoch}

    async def check_health(self) -> None:
        """The leader checks its own duties; a follower reports the fault the leader last published."""
        if self.is_leader or self.placement.solo:
            if self._leader_check is not None:
                result = self._leader_check()
                if result is not None:
                    await result
            return
        fault = await self._redis.get(keys.LEADER_FAULT)
        if fault:
            raise RuntimeError(fault.decode(errors="replace"))

    async def wait_alone(self, timeout_s: float) -> int:
        """Shutdown: wait until no other worker of this boot is a member (each leaves once its server drained),
        at most `timeout_s`. Returns how many were still there."""
        if self.placement.solo:
            return 0
        deadline = time.monotonic() + timeout_s
        while True:
            others = [m for m in await self.membership.members(live_only=True) if m != self.member]
            if not others or time.monotonic() >= deadline:
                return len(others)
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------ heartbeat

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout(self._beat_s * 2):
                    await self._beat_once(loop)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis unreachable or slow: the fence timer still deposes a leader in time
                now = time.monotonic()
                if now - self._last_warning > 10:
                    self._last_warning = now
                    log.warning("worker %d heartbeat failed: %s", self.placement.index, exc or type(exc).__name__)
            await asyncio.sleep(self._beat_s)

    async def _beat_once(self, loop: asyncio.AbstractEventLoop) -> None:
        now_ms = int(time.time() * 1000)
        fault = await self._leader_fault() if self.is_leader else None
        sent = loop.time()
        async with self._redis.pipeline(transaction=False) as pipe:  # independent commands, one round trip
            pipe.zadd(keys.WORKERS, {self.member: now_ms + int(self._ttl_s * 1000)})
            pipe.zremrangebyscore(keys.WORKERS, "-inf", now_ms)
            pipe.zcard(keys.WORKERS)
            pipe.get(keys.SERVICE_BOOT)
            _, _, live, booted = await pipe.execute()
        self.live_workers = int(live)
        if self.is_leader:
            if await self._lease.renew(self._fence, fault):  # the fault is published by the renewal: fenced
                self._renewed(loop, sent)
            else:
                log.error("worker %d lost the leader lease (epoch %d); stopping its duties",
                          self.placement.index, self.epoch)
                await self._depose(shutdown=False)
            return
        epoch = await self._lease.acquire()
        if epoch:
            self.is_leader, self.epoch = True, epoch
            self._fence.grant(epoch)
            self._renewed(loop, sent)
            first = booted is None or booted.decode() != self.placement.boot
            log.info("worker %d is the leader (epoch %d)%s", self.placement.index, epoch,
                     "; running startup recovery" if first else "; taking over the duties")
            self._office = asyncio.create_task(self._take_office(first), name="leader-take-office")
            return
        if booted is not None and booted.decode() == self.placement.boot:
            self._set_ready()
            await self._duties.follow()

    async def _leader_fault(self) -> str | None:
        try:
            await self.check_health()
        except Exception as exc:
            return str(exc) or type(exc).__name__
        return None

    def _renewed(self, loop: asyncio.AbstractEventLoop, sent: float) -> None:
        """A renewal sent at `sent` succeeded: valid until sent + TTL − margin; the fence timer moves there."""
        self._valid_until = sent + self._ttl_s - self._margin_s
        if self._fence_timer is not None:
            self._fence_timer.cancel()
        self._fence_timer = loop.call_at(self._valid_until, self._fence_expired)

    def _fence_expired(self) -> None:
        self._fence_timer = None
        self._fence.revoke()  # the term's validity is over here: its writes fail without asking Redis
        if not self.is_leader or self._deposing is not None:
            return
        log.error("worker %d: leader lease not renewed in time; stopping its duties (epoch %d)",
                  self.placement.index, self.epoch)
        self._deposing = asyncio.create_task(self._depose(shutdown=False), name="leader-fenced")
        self._deposing.add_done_callback(lambda _: setattr(self, "_deposing", None))

    async def _take_office(self, first_of_boot: bool) -> None:
        try:
            await self._duties.take_office(first_of_boot=first_of_boot)
            if first_of_boot:
                await self._fence.write(self._redis, lambda pipe: pipe.set(keys.SERVICE_BOOT, self.placement.boot))
        except asyncio.CancelledError:
            raise
        except LeaseLost as exc:
            # Deposed while recovering (stopped past the TTL, say): the next leader recovers again, and marks the
            # boot recovered for this worker too. Not a failed start.
            log.error("worker %d lost the leader lease while taking office (epoch %d): %s", self.placement.index,
                      self.epoch, exc)
            await self._depose(shutdown=False)
            return
        except Exception as exc:
            if self._ready is not None and not self._ready.done() and first_of_boot:
                self._ready.set_exception(exc)  # startup fails: the worker exits, the group stops the others
                return
            log.exception("worker %d could not take over the duties; handing the lease back", self.placement.index)
            await self._depose(shutdown=False)
            with suppress(Exception):
                await self._lease.release()
            return
        self._set_ready()

    def _set_ready(self) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    async def _depose(self, *, shutdown: bool) -> None:
        """Stop the duties. Deposed, the term ends first, so nothing the duties still write on their way out lands;
        at shutdown it ends once they are handed in (the shutdown steps are this term's writes)."""
        if not shutdown:
            self._end_term()
        office, self._office = self._office, None
        # Never the running task itself (taking office failed): cancelling it would cut this very call short.
        if office is not None and office is not asyncio.current_task() and not office.done():
            office.cancel()
            await asyncio.gather(office, return_exceptions=True)
        was_leader, self.is_leader = self.is_leader, False
        if was_leader:
            try:
                await self._duties.leave_office(shutdown=shutdown)
            except Exception:
                log.exception("worker %d: stopping the leader duties failed", self.placement.index)
        self._end_term()

    def _end_term(self) -> None:
        if self._fence_timer is not None:
            self._fence_timer.cancel()
            self._fence_timer = None
        self._fence.revoke()

    async def _keep_lease(self) -> None:
        """Shutdown: renew the term while the leader hands in its duties; a refused renewal ends it (the steps
        left then fail with LeaseLost), and so does the timer if no renewal succeeds in time."""
        loop = asyncio.get_running_loop()
        while True:
            sent = loop.time()
            try:
                async with asyncio.timeout(self._beat_s * 2):
                    renewed = await self._lease.renew(self._fence, None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis unreachable: the timer ends the term if this lasts
                log.warning("worker %d: renewing the lease during shutdown failed: %s", self.placement.index,
                            exc or type(exc).__name__)
            else:
                if not renewed:
                    self._end_term()
                    return
                self._renewed(loop, sent)
            await asyncio.sleep(self._beat_s)


async def _cancelled(task: asyncio.Task[None], every_s: float) -> None:
    """Cancel `task` and wait until it is done, cancelling again every `every_s`: a cancellation that lands while a
    Redis call is in flight can be swallowed on the way out (seen after an event-loop stall past the TTL: the
    heartbeat then beat on for ever and the worker's stop hung). The loops stopped here hold no state to finish."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every_s)
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s ended with %r", task.get_name(), task.exception())
