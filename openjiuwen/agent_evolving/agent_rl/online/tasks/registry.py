"""Redis TaskRegistry: every Task transition (start, finalize, abort, listing, events) as one atomic unit (CONTRACT
§4, §5), an optimistic transaction. A Task's captures are capture/ledger.py's, its turn publication
capture/turn_ledger.py's.

Each method states the invariant of CONTRACT §5.4 it keeps. Methods raise domain errors (NotFound, Conflict) and
never decide HTTP statuses.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from .. import events
from ..errors import Conflict, NotFound
from ..lineage_state import require_live
from ...common.ids import is_token_id, now_iso, parse_iso_epoch
from ...common.lineage import DEFAULT_LINEAGE
from ..store import keys
from ..store.codec import text
from ..store.lineage_listing import TASK_LISTING
from ..store.listing import newest_first
from ..store.tx import transact
from ..store.fence import UNFENCED, Fence
from ...common.wire.task_states import TASK_STATUSES, FinishReason, RewardMode, TaskStatus
from .task_records import Task, read_task
from .signals import TaskSignals

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics


log = logging.getLogger("openjiuwen.agent_rl.online.tasks")

class TaskRegistry:
    def __init__(
        self, redis: Redis, *, signals: TaskSignals | None = None, metrics: "ServiceMetrics | None" = None,
        max_lineages: int = 1000,
    ) -> None:
        self._redis = redis
        self._max_lineages = max_lineages  # `lineages.max_count`: registered lineages besides `default`
        self.signals = signals or TaskSignals()
        self._metrics = metrics

    # ------------------------------------------------------------------ Tasks

    async def get(self, rl_task_id: str) -> Task | None:
        raw = await self._redis.get(keys.task(rl_task_id))
        return None if raw is None else Task.from_json(raw)

    async def require(self, rl_task_id: str) -> Task:
        task = await self.get(rl_task_id)
        if task is None:
            raise NotFound("RL Task not found")
        return task

    async def start(self, requested: Task, *, lineage_cap: int | None = None) -> tuple[Task, bool]:
        """Create or reuse a Task; returns (record, created).

        Invariant 1: at most one active Task per session; the pointer, the record and the active index move
        together, and concurrent starts on one session (from any number of processes) converge on one Task.
        The session's active Task is answered only to the operator (no agent key) or to the agent key that started
        it: for another agent key it is a Conflict (it cannot start a second Task there, nor see the first).
        A new Task needs a live lineage (Conflict `lineage_archived` / `lineage_deleting`); `lineage_cap`: the
        agent key's cap on the lineages it registers (`agentHmacKeys[i].maxLineages`, sent by the gateway)."""
        t, s = requested.rl_task_id, requested.agent_session_id
        task_key, pointer_key = keys.task(t), keys.active_session(s)

        async def body(pipe: Pipeline) -> tuple[Task, bool]:
            raw = await pipe.get(task_key)
            if raw is not None:
                existing = Task.from_json(raw)
                if existing.spec() != requested.spec():
                    raise Conflict("RL Task exists with a different spec")
                return existing, False
            other_id = text(await pipe.get(pointer_key))
            if other_id is not None and other_id != t:
                other_key = keys.task(other_id)
                await pipe.watch(other_key)  # the pointed Task must not change under our decision
                other_raw = await pipe.get(other_key)
                if other_raw is not None:
                    other = Task.from_json(other_raw)
                    if other.active:
                        if not other.answers_to(requested.agent_key_id):
                            raise Conflict("the session has an active RL Task started with another key")
                        if other.lineage != requested.lineage:
                            # Never answer a Task of another lineage: its samples would train the wrong line.
                            raise Conflict(f"the session has an active RL Task of lineage {other.lineage!r}; stop it "
                                           f"before starting one of lineage {requested.lineage!r}")
                        return other, False
            created = parse_iso_epoch(requested.created_at)
            # WATCHed: an archive or deletion that lands before this EXEC fails it, and the retry refuses.
            await require_live(pipe, requested.lineage)
            register = await self._lineage_to_register(pipe, requested.lineage, requested.agent_key_id, lineage_cap)
            pipe.multi()
            if register:
                # A lineage exists once a Task of it exists: registered in the Task's own EXEC, so neither is seen
                # without the other, and the count checks above (under WATCH of the ZSET) hold at EXEC. The key
                # that registered it is counted in the same EXEC (the invariant of keys.LINEAGES_COUNT_BY_KEY).
                pipe.zadd(keys.LINEAGES, {requested.lineage: created}, nx=True)
                if requested.agent_key_id is not None:
                    pipe.hset(keys.LINEAGES_REGISTERED_BY, requested.lineage, requested.agent_key_id)
                    pipe.hincrby(keys.LINEAGES_COUNT_BY_KEY, requested.agent_key_id, 1)
            if requested.lineage != DEFAULT_LINEAGE:
                # The idle sweep's clock (keys.LINEAGES_LAST_TASK): a live lineage's latest Task start.
                pipe.zadd(keys.LINEAGES_LAST_TASK, {requested.lineage: created}, gt=True)
            pipe.set(task_key, requested.to_json())
            pipe.set(pointer_key, t)
            pipe.sadd(keys.ACTIVE_TASKS, t)
            # The listing indexes and the timeline start with the record (one EXEC: a listed Task always exists).
            # Invariant: a Task is in its lineage's indexes exactly when it is in the overall ones (same EXEC).
            pipe.zadd(keys.TASKS_BY_CREATION, {t: created})
            pipe.zadd(keys.tasks_by_status(TaskStatus.ACTIVE), {t: created})
            pipe.zadd(TASK_LISTING.index(requested.lineage), {t: created})
            pipe.zadd(TASK_LISTING.index(requested.lineage, TaskStatus.ACTIVE), {t: created})
            if is_token_id(requested.policy_lora_name):  # per-version Task count (GET /v1/rl/policies)
                pipe.hincrby(keys.policy_stats(requested.policy_lora_name), "tasks", 1)
                if requested.evaluation:
                    pipe.hincrby(keys.policy_stats(requested.policy_lora_name), "eval_tasks", 1)
                pipe.sadd(keys.POLICY_VERSIONS, requested.policy_lora_name)
            events.queue(pipe, keys.task_events(t), "created", {
                "agent_session_id": s, "reward_mode": requested.reward_mode,
                "policy_lora_name": requested.policy_lora_name,
                **({"evaluation": True} if requested.evaluation else {}),
                **({"agent_key_id": requested.agent_key_id} if requested.agent_key_id is not None else {}),
                **({"lineage": requested.lineage} if requested.lineage != DEFAULT_LINEAGE else {}),
            }, at=requested.created_at)
            await pipe.execute()
            return requested, True

        task, created = await transact(self._redis, body, task_key, pointer_key)
        if created:
            log.info("task %s created for session %s on %s (%s)", t, s, task.policy_lora_name, task.reward_mode,
                     extra={"rl_task_id": t})
            if self._metrics is not None:
                self._metrics.task_created(task.reward_mode)
        return task, created

    async def _lineage_to_register(self, pipe: Pipeline, lineage: str, agent_key: str | None,
                                   cap: int | None) -> bool:
        """Whether starting a Task of `lineage` registers it (a lineage not yet in `rl:v1:lineages`); Conflict
        `lineage_limit_reached` when that would pass `lineages.max_count`, `agent_lineage_limit_reached` when the
        agent key already registered `cap` lineages. `default` is never registered: it always exists. A registered
        lineage leaves the registry only through its deletion, whose first step marks its state (WATCHed by the
        caller), so only a new one WATCHes the ZSET (its count, and with it every key's count)."""
        if lineage == DEFAULT_LINEAGE or await pipe.zscore(keys.LINEAGES, lineage) is not None:
            return False
        await pipe.watch(keys.LINEAGES)
        if await pipe.zscore(keys.LINEAGES, lineage) is not None:
            return False
        if await pipe.zcard(keys.LINEAGES) >= self._max_lineages:
            raise Conflict(f"lineage {lineage!r} would pass lineages.max_count ({self._max_lineages} lineages)",
                           code="lineage_limit_reached")
        if cap is not None and agent_key is not None:
            registered = int(await pipe.hget(keys.LINEAGES_COUNT_BY_KEY, agent_key) or 0)
            if registered >= cap:
                raise Conflict(f"the agent key {agent_key!r} registered {registered} lineage(s), its cap "
                               f"(maxLineages {cap}); lineage {lineage!r} is not registered",
                               code="agent_lineage_limit_reached")
        return True

    async def finalize(self, rl_task_id: str, reason: FinishReason) -> Task:
        """active → finalized. Requires zero open captures (Invariant 2); a finalized terminal-mode Task with
        staged samples waits in the awaiting-reward index, any other goes to the gc index."""
        t = rl_task_id

        async def body(pipe: Pipeline, task: Task) -> tuple[TaskStatus, list[str]]:
            if await pipe.scard(keys.open_captures(t)):
                raise Conflict("RL Task has open captures")
            awaits_reward = task.reward_mode == RewardMode.TERMINAL and await pipe.scard(keys.committed_captures(t))
            return TaskStatus.FINALIZED, [keys.TASKS_AWAITING_REWARD if awaits_reward else keys.TASKS_GC]

        return await self._terminal(t, reason, body, lambda pipe: None)

    async def abort(self, rl_task_id: str, reason: FinishReason, *, fence: Fence = UNFENCED) -> Task:
        """active → aborted. Invariants 2 and 3: the open captures (metadata, memberships, open set) and every
        staged sample go with the transition; published samples stay. `fence`: the leader's, when its startup
        recovery aborts the Tasks of a previous boot; any worker's abort is unfenced."""
        t = rl_task_id
        open_ids: list[str] = []
        committed_ids: list[str] = []

        async def body(pipe: Pipeline, task: Task) -> tuple[TaskStatus, list[str]]:
            open_ids[:] = [text(c) for c in await pipe.smembers(keys.open_captures(t))]
            committed_ids[:] = [text(c) for c in await pipe.smembers(keys.committed_captures(t))]
            return TaskStatus.ABORTED, [keys.TASKS_GC]

        def extra_writes(pipe: Pipeline) -> None:
            if open_ids:
                pipe.delete(*(keys.capture(t, c) for c in open_ids))
                pipe.srem(keys.captures(t), *open_ids)
            pipe.delete(keys.open_captures(t))
            if committed_ids:
                pipe.delete(*(keys.staged(t, c) for c in committed_ids))

        return await self._terminal(t, reason, body, extra_writes, fence)

    async def _terminal(
        self,
        t: str,
        reason: FinishReason,
        decide: Callable[[Pipeline, Task], Awaitable[tuple[TaskStatus, list[str]]]],
        extra_writes: Callable[[Pipeline], None],
        fence: Fence = UNFENCED,
    ) -> Task:
        """One terminal transition (CONTRACT §4.1): a non-active Task is returned unchanged (sticky); else the record,
        the session pointer (cleared only if it still names this Task), the active index and the retention index
        change in one EXEC, together with the transition's own writes. Invariant 1."""
        task_key, open_key, committed_key = keys.task(t), keys.open_captures(t), keys.committed_captures(t)

        async def body(pipe: Pipeline) -> Task:
            task = await self._read_task(pipe, task_key)
            if not task.active:
                return task
            status, indexes = await decide(pipe, task)
            pointer_key = keys.active_session(task.agent_session_id)
            await pipe.watch(pointer_key)
            pointer = text(await pipe.get(pointer_key))
            now = now_iso()
            done = task.terminal(status, reason, now)
            pipe.multi()
            pipe.set(task_key, done.to_json())
            if pointer == t:
                pipe.delete(pointer_key)
            pipe.srem(keys.ACTIVE_TASKS, t)
            extra_writes(pipe)
            for index in indexes:
                pipe.zadd(index, {t: parse_iso_epoch(now)})
            # The status listing indexes (overall and the lineage's: the same invariant as at start) and the
            # timeline move with the record.
            pipe.zrem(keys.tasks_by_status(TaskStatus.ACTIVE), t)
            pipe.zadd(keys.tasks_by_status(status), {t: parse_iso_epoch(task.created_at)})
            pipe.zrem(TASK_LISTING.index(task.lineage, TaskStatus.ACTIVE), t)
            pipe.zadd(TASK_LISTING.index(task.lineage, status), {t: parse_iso_epoch(task.created_at)})
            events.queue(pipe, keys.task_events(t), status.value, {"reason": reason.value}, at=now)
            await pipe.execute()
            transitioned.append(True)
            return done

        transitioned: list[bool] = []
        task = await fence.transact(self._redis, body, task_key, open_key, committed_key)
        self.signals.notify(t)
        if transitioned:
            log.info("task %s %s (%s)", t, task.status, reason.value, extra={"rl_task_id": t})
            if self._metrics is not None:
                self._metrics.task_finished(task.status, reason.value)
        return task

    async def list_page(
        self, status: str | None, limit: int, cursor: str | None, lineage: str | None = None,
    ) -> dict[str, Any]:
        """Task records newest first by creation (`GET /v1/rl/tasks`), from the creation-time listing indexes; with
        `lineage`, from that lineage's own indexes (O(page): other lineages' ids are never read).

        An id whose record is gone (expired by retention) is dropped from the indexes on the way; a record whose
        status changed between the index read and the record read is left out of a filtered page."""
        if lineage is None:
            index = keys.TASKS_BY_CREATION if status is None else keys.tasks_by_status(status)
            scope = status or "*"  # the cursor of the unfiltered listing, as before lineages
        else:
            index, scope = TASK_LISTING.index(lineage, status), f"{lineage}/{status or '*'}"
        ids, next_cursor = await newest_first(self._redis, index, limit=limit, cursor=cursor, scope=scope)
        raws = await self._redis.mget([keys.task(t) for t in ids]) if ids else []
        items, gone = [], []
        for t, raw in zip(ids, raws):
            if raw is None:
                gone.append(t)
                continue
            task = Task.from_json(raw)
            if (status is None or task.status == status) and (lineage is None or task.lineage == lineage):
                items.append(task.public())
        if gone:
            await self.forget(gone, lineage)
        return {"items": items, "next_cursor": next_cursor}

    async def forget(self, rl_task_ids: list[str], lineage: str | None = None) -> None:
        """Drop ids whose records expired from every listing index (the record, not the index, is the truth):
        the overall ones and their lineage's (`lineage` when the caller read that lineage's index, else the one
        recorded when the record got its TTL)."""
        lineages = ([lineage] * len(rl_task_ids) if lineage is not None
                    else await TASK_LISTING.lineages_of(self._redis, rl_task_ids))
        async with self._redis.pipeline(transaction=False) as pipe:
            for index in (keys.TASKS_BY_CREATION, *(keys.tasks_by_status(s) for s in TASK_STATUSES),
                          keys.TASKS_LISTING_EXPIRY):
                pipe.zrem(index, *rl_task_ids)
            TASK_LISTING.queue_forget(pipe, rl_task_ids, lineages)
            await pipe.execute()

    async def events(self, rl_task_id: str) -> list[dict[str, Any]]:
        """The Task timeline oldest first; NotFound for an unknown Task."""
        await self.require(rl_task_id)
        return await events.EventLog(self._redis).read(keys.task_events(rl_task_id))

    async def active_ids(self) -> list[str]:
        return sorted(text(t) for t in await self._redis.smembers(keys.ACTIVE_TASKS))

    async def drop_stale_active(self, rl_task_id: str, *, fence: Fence) -> None:
        """Remove an id from the active index whose record is missing or no longer active (startup recovery's
        repair, through the leader's fence)."""
        await fence.write(self._redis, lambda pipe: pipe.srem(keys.ACTIVE_TASKS, rl_task_id))

    # -------------------------------------------------------------- internals

    @staticmethod
    async def _read_task(pipe: Pipeline, task_key: str) -> Task:
        return await read_task(pipe, task_key)
