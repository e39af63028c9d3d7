"""The retention sweeper (CONTRACT §5.5): TTLs for terminal Tasks, expiry of unrewarded staged samples, removal of
old trained/failed samples. Bounded work per category per tick; safe to run in several processes at once. A leader
duty: its writes go through the leader's fence (store/fence.py), and a refused one (LeaseLost) ends the loop.
Finishing an interrupted reward projection is not fenced: any worker does it (`RewardProjector.project`).

Lines (docs/lineages.md): old samples are removed from the default line every tick and from `_LINES_PER_TICK` other
lines per tick, taken in turn from the lineage registry (`rl:v1:lineages`, by rank) with a cursor kept in this
process: with thousands of lineages each is still visited every few ticks, and no tick reads them all. Retention
is days, a tick a minute: a visit every few minutes is on time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from . import events
from ..common.lineage import DEFAULT_LINEAGE, is_lineage, line_of
from .background import stop_loop
from .rewards.projector import RewardProjector
from .store import keys
from .store.codec import text
from .store.lineage_listing import RUN_LISTING, TASK_LISTING
from .store.sample_deletion import SampleDeletion
from .store.sample_line import SampleLine
from ..common.wire.task_states import TASK_STATUSES
from .tasks.task_keys import keys_of_task
from .tasks.task_records import Task, TerminalReward
from .store.fence import Fence, LeaseLost

log = logging.getLogger("openjiuwen.agent_rl.online.retention")

BATCH = 1000
_LINES_PER_TICK = 64


class RetentionSweeper:
    def __init__(
        self,
        redis: Redis,
        line: SampleLine,
        deletion: SampleDeletion,
        rewards: RewardProjector,
        *,
        owner: str,
        task_retention_s: int,
        reward_timeout_s: int,
        trajectory_retention_s: int,
        run_retention_s: int,
        interval_s: float,
        fence: Fence,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self._redis, self._fence, self._rewards = redis, fence, rewards
        self._line, self._deletion = line, deletion  # the default line; the sweep deletes through `deletion`
        self._owner = owner
        # How long each kind of record lives, and how often the sweep runs.
        self._task_retention_s, self._reward_timeout_s = task_retention_s, reward_timeout_s
        self._trajectory_retention_s, self._run_retention_s = trajectory_retention_s, run_retention_s
        self._interval_s, self._on_error = interval_s, on_error
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._line_cursor = 0  # rank in `rl:v1:lineages` of the next lineage whose line's samples are swept

    async def sweep_once(self, *, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        expired = await self._expire_unrewarded(now)
        gc = await self._ttl_terminal_tasks()
        samples = await self._deletion.sweep_expired(self._line, retention_seconds=self._trajectory_retention_s,
                                                     now=now, limit=BATCH, fence=self._fence)
        samples += await self._sweep_lineage_lines(now)
        listings = await self._forget_expired_listings(now)
        return {"tasks_ttl": gc, "reward_expired": expired, "samples_removed": samples, "listings_removed": listings}

    async def _sweep_lineage_lines(self, now: float) -> int:
        """Old samples of the next `_LINES_PER_TICK` registered lineages' lines; the cursor wraps at the end.
        New lineages mostly rank last and a deleted one only shifts the ranks after it by one, so a rank cursor
        misses none for long."""
        start = self._line_cursor
        lineages = [text(m) or "" for m in await self._redis.zrange(keys.LINEAGES, start, start + _LINES_PER_TICK - 1)]
        self._line_cursor = start + len(lineages) if len(lineages) == _LINES_PER_TICK else 0
        removed = 0
        for lineage in lineages:
            try:
                line = self._line.for_line(line_of(self._owner, lineage))
            except ValueError:
                continue  # not a lineage name: never registered by us
            removed += await self._deletion.sweep_expired(line, retention_seconds=self._trajectory_retention_s,
                                                          now=now, limit=BATCH, fence=self._fence)
        return removed

    async def _forget_expired_listings(self, now: float) -> int:
        """Remove from the listing indexes the ids whose records have expired: those due in the listing-expiry
        ZSETs (at most BATCH each) whose record is gone; one still present (clock skew) waits for the next tick."""
        removed = 0
        task_indexes = (keys.TASKS_BY_CREATION, *(keys.tasks_by_status(s) for s in TASK_STATUSES))
        for expiry, record_key, indexes, per_lineage in (
            (keys.TASKS_LISTING_EXPIRY, keys.task, task_indexes, TASK_LISTING),
            (keys.RUNS_LISTING_EXPIRY, keys.training_run, (keys.RUNS_BY_CREATION,), RUN_LISTING),
        ):
            ids = [text(m) or "" for m in await self._redis.zrangebyscore(expiry, "-inf", now, 0, BATCH)]
            if not ids:
                continue
            async with self._redis.pipeline(transaction=False) as reads:
                for member in ids:
                    reads.exists(record_key(member))
                present = await reads.execute()
            gone = [member for member, exists in zip(ids, present) if not exists]
            if gone:
                lineages = await per_lineage.lineages_of(self._redis, gone)

                def forget(pipe: Pipeline) -> None:  # awaited below, within this iteration
                    # The lineage indexes lose an id in the same EXEC as the overall ones (their invariant).
                    for listing in (*indexes, expiry):
                        pipe.zrem(listing, *gone)
                    per_lineage.queue_forget(pipe, gone, lineages)

                await self._fence.write(self._redis, forget)
                removed += len(gone)
        return removed

    async def _ttl_terminal_tasks(self) -> int:
        ids = [text(t) for t in await self._redis.zrange(keys.TASKS_GC, 0, BATCH - 1)]
        for t in ids:
            task_keys = await keys_of_task(self._redis, t)
            lineage = _lineage_of_record(await self._redis.get(keys.task(t)))

            def queue(pipe: Pipeline) -> None:  # awaited below, within this iteration
                for key in task_keys:
                    pipe.expire(key, self._task_retention_s)
                # The listing entry goes once the record has expired (`_forget_expired_listings`).
                pipe.zadd(keys.TASKS_LISTING_EXPIRY, {t: time.time() + self._task_retention_s})
                TASK_LISTING.queue_expiring(pipe, t, lineage)  # which lineage index to trim then
                pipe.zrem(keys.TASKS_GC, t)

            await self._fence.write(self._redis, queue)
        return len(ids)

    async def _expire_unrewarded(self, now: float) -> int:
        cutoff = now - self._reward_timeout_s
        ids = [text(t) for t in await self._redis.zrangebyscore(keys.TASKS_AWAITING_REWARD, "-inf", cutoff, 0, BATCH)]
        dropped_total = 0
        for t in ids:
            state_raw = await self._redis.get(keys.reward(t))
            state = orjson.loads(state_raw) if state_raw else None
            if state is None:
                dropped_total += await self._expire_one(t)
            elif state.get("status") == TerminalReward.PROJECTING:
                await self._rewards.project(t, float(state["reward"]))
            else:
                await self._move_to_gc(t)
        return dropped_total

    async def _expire_one(self, t: str) -> int:
        reward_key, committed_key = keys.reward(t), keys.committed_captures(t)
        raw_task = await self._redis.get(keys.task(t))
        lineage = Task.from_json(raw_task).lineage if raw_task else None
        # The dropped samples are counted on the Task's own line (docs/lineages.md).
        stats_key = self._line.for_lineage(lineage).stats_key

        # Invariant 3: the staged samples go with the `expired` state and the move to gc; the counter of dropped
        # samples moves in the same step, so it never double counts when two sweepers race.
        async def body(pipe: Pipeline) -> int:
            if await pipe.exists(reward_key):
                return 0  # a reward arrived meanwhile; the next tick handles its state
            committed = [text(c) for c in await pipe.smembers(committed_key)]
            staged_keys = [keys.staged(t, c) for c in committed]
            present = int(await pipe.exists(*staged_keys)) if staged_keys else 0
            pipe.multi()
            pipe.set(reward_key, orjson.dumps({"reward": None, "status": TerminalReward.EXPIRED, "sample_count": 0}))
            if staged_keys:
                pipe.delete(*staged_keys)
            if present:
                pipe.hincrby(stats_key, "expired_unrewarded", present)
            pipe.zrem(keys.TASKS_AWAITING_REWARD, t)
            pipe.zadd(keys.TASKS_GC, {t: time.time()})
            events.queue(pipe, keys.task_events(t), "reward_expired", {"dropped_samples": present})
            await pipe.execute()
            return present

        dropped = await self._fence.transact(self._redis, body, reward_key, committed_key)
        log.info("task %s: reward window expired, %d staged sample(s) dropped", t, dropped, extra={"rl_task_id": t})
        return dropped

    async def _move_to_gc(self, t: str) -> None:
        def queue(pipe: Pipeline) -> None:
            pipe.zrem(keys.TASKS_AWAITING_REWARD, t)
            pipe.zadd(keys.TASKS_GC, {t: time.time()})

        await self._fence.write(self._redis, queue)

    # ------------------------------------------------------------ background

    def start(self) -> None:
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="retention-sweeper")

    async def _run(self) -> None:
        # The stop event ends the loop, not only the cancellation: redis-py can swallow a cancellation that lands
        # inside a command, which would leave stop() awaiting a loop that goes on.
        while not self._stopping.is_set():
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._interval_s)
            if self._stopping.is_set():
                return
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except LeaseLost as exc:  # deposed: the next leader sweeps
                log.warning("retention sweeps stop: %s", exc)
                return
            except Exception as exc:
                log.exception("retention sweep failed; retrying next interval")
                if self._on_error is not None:
                    self._on_error(exc)

    async def stop(self) -> None:
        await stop_loop(self._task, self._stopping)
        self._task = None


def _lineage_of_record(raw: bytes | None) -> str:
    """The lineage a Task record names (absent or unreadable: `default`). Read leniently: retention must never
    stop on one odd record, and only the listing trim uses it."""
    try:
        record = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return DEFAULT_LINEAGE
    lineage = record.get("lineage") if isinstance(record, dict) else None
    return lineage if is_lineage(lineage) else DEFAULT_LINEAGE
