"""Redis TaskRegistry: every Task, capture and turn transition as one atomic unit (CONTRACT §4, §5): an optimistic
transaction, or for the capture hooks' transitions one Lua script (`capture_scripts.py`).

Each method states the invariant of CONTRACT §5.4 it keeps. Methods raise domain errors (NotFound, Conflict) and
never decide HTTP statuses.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, NoReturn

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from .. import events
from . import capture_scripts as scripts
from ..errors import Conflict, NotFound
from ..lineage_state import require_live
from ...common.ids import is_token_id, now_iso, parse_iso_epoch
from ...common.lineage import DEFAULT_LINEAGE
from ..store import keys
from ..store.codec import PackedSample, text
from ..store.lineage_listing import TASK_LISTING
from ..store.listing import newest_first
from ..store.tx import MAX_WATCH_RETRIES, RedisContention, transact
from ..store.fence import UNFENCED, Fence
from ...common.wire.task_states import TASK_STATUSES, FinishReason, RewardMode, TaskStatus
from .task_records import TURN_PUBLICATION_TRANSITIONS, CaptureMeta, CaptureStatus, Task, TurnPublication
from .signals import TaskSignals

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics


log = logging.getLogger("openjiuwen.agent_rl.online.tasks")

# Bounds of the hook path's in-process memories (`TaskRegistry.task_facts`, the open-capture hints of `commit`):
# past them the oldest entries go, and a hook of a forgotten Task or capture costs one more round trip.
FACTS_CACHE_SIZE = 4096
OPEN_HINTS_SIZE = 4096


class AbortingConflict(Conflict):
    """A conflict after which the Task must be aborted `capture_failed` (closed or closing turn)."""


class StaleTask(Exception):
    """The Task id names another Task than the facts a hook validated against (its record expired and the id was
    started again). Nothing was written; the hook is redone with `task`, the Task as it is now."""

    def __init__(self, task: Task) -> None:
        super().__init__(f"RL Task {task.rl_task_id} is another Task now")
        self.task = task


class ReserveOutcome(Enum):
    RESERVED = "reserved"
    IDEMPOTENT = "idempotent"
    PUBLISH_CURRENT = "publish_current"  # delayed mode: the current turn must be published first


@dataclass(frozen=True, slots=True)
class Reservation:
    outcome: ReserveOutcome
    current_turn: str | None = None  # set with PUBLISH_CURRENT


class TaskRegistry:
    def __init__(
        self, redis: Redis, *, signals: TaskSignals | None = None, metrics: "ServiceMetrics | None" = None,
        max_lineages: int = 1000,
    ) -> None:
        self._redis = redis
        self._max_lineages = max_lineages  # `lineages.max_count`: registered lineages besides `default`
        self.signals = signals or TaskSignals()
        self._metrics = metrics
        self._scripts = scripts.CaptureScripts(redis)
        # The hook path's memories (`task_facts`, `commit`): caches of facts the scripts verify, never the truth.
        self._facts: dict[str, Task] = {}
        self._open_hints: dict[tuple[str, str], bytes] = {}  # (task, capture) → the open metadata we reserved

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

    # --------------------------------------------------------------- Captures

    async def task_facts(self, rl_task_id: str) -> tuple[Task, bool]:
        """The Task a hook validates against, and whether it came from this process's memory.

        Only the fields a Task never changes may be used from it (`Task.spec()`, `rl_task_id`, `created_at`): a
        Task's spec is fixed at start (a start with another spec is a conflict), so they are facts of the id for as
        long as its record exists. `status` may be stale and is never read from it: the capture scripts read the
        live status, and check existence and identity (`created_at`) themselves, so a remembered Task never decides
        anything the record contradicts, whichever process changed it. NotFound for an unknown Task (not
        remembered)."""
        task = self._facts.get(rl_task_id)
        if task is not None:
            return task, True
        task = await self.require(rl_task_id)
        return self._remember(task), False

    async def confirm(self, task: Task) -> None:
        """Before answering an error found with remembered facts: the Task must still exist (NotFound, as the read
        that was skipped would have answered first) and be the same Task (StaleTask)."""
        raw = await self._redis.get(keys.task(task.rl_task_id))
        if raw is None:
            self._facts.pop(task.rl_task_id, None)
            raise NotFound("RL Task not found")
        current = Task.from_json(raw)
        if current.created_at != task.created_at:
            raise StaleTask(self._remember(current))

    def _remember(self, task: Task) -> Task:
        facts = self._facts
        if task.rl_task_id not in facts and len(facts) >= FACTS_CACHE_SIZE:
            del facts[next(iter(facts))]  # the oldest entry: a forgotten Task costs one read at its next hook
        facts[task.rl_task_id] = task
        return task

    def _hint_open(self, t: str, capture_id: str, meta_json: bytes) -> None:
        hints = self._open_hints
        key = (t, capture_id)
        if key not in hints and len(hints) >= OPEN_HINTS_SIZE:
            del hints[next(iter(hints))]
        hints[key] = meta_json

    def reserved_fingerprint(self, rl_task_id: str, capture_id: str, turn_id: str | None) -> str | None:
        """The request fingerprint this process stored when it reserved the capture at `:before`, while the capture is
        open for `turn_id` as far as this process knows (its own reservation hint; no Redis read); else None. A hint
        is no proof: the commit script still checks the stored record."""
        hint = self._open_hints.get((rl_task_id, capture_id))
        if hint is None:
            return None
        meta = CaptureMeta.from_json(hint)
        if meta.status != CaptureStatus.OPEN or meta.agent_turn_id != turn_id:
            return None
        return meta.request_fingerprint

    def _task_reply(self, t: str, reply: list[Any]) -> NoReturn:
        """NOT_FOUND and TASK_CHANGED, the answers every capture script may give before deciding anything."""
        if reply[0] == scripts.TASK_CHANGED:
            raise StaleTask(self._remember(Task.from_json(reply[1])))
        self._facts.pop(t, None)
        raise NotFound("RL Task not found")

    async def reserve(
        self, task: Task, capture_id: str, turn_id: str | None, request_fingerprint: str
    ) -> Reservation:
        """Reserve an open capture (CONTRACT §4.2 before, §4.3 for delayed mode), in one script round trip
        (`capture_scripts.RESERVE`).

        Invariant 2: the metadata, the `captures` set and the open set change together. Invariant 7: a closed
        turn never accepts a capture, and the current turn only moves forward through `advance_turn`."""
        t = task.rl_task_id
        script_keys = [keys.task(t), keys.capture(t, capture_id), keys.captures(t), keys.open_captures(t),
                       keys.task_events(t)]
        delayed = task.delayed  # reward_mode never changes for a Task (the script checks it is the same Task)
        if delayed:
            assert turn_id is not None
            script_keys += [
                keys.turn_current(t), keys.turn_transition(t), keys.turns_closed(t), keys.turn_publish(t, turn_id),
            ]
        meta = CaptureMeta(capture_id, turn_id, request_fingerprint, None, CaptureStatus.OPEN, now_iso())
        meta_json = meta.to_json()
        reply = await self._scripts.reserve(keys=script_keys, args=[
            task.created_at, capture_id, turn_id or "", meta_json, meta.created_at,
            events.encode_data({"capture_id": capture_id, "agent_turn_id": turn_id}), "1" if delayed else "0",
        ])
        code = reply[0]
        if code == scripts.DONE:
            self._hint_open(t, capture_id, meta_json)
            return Reservation(ReserveOutcome.RESERVED)
        if code == scripts.CAPTURE_EXISTS:
            existing = CaptureMeta.from_json(reply[1])
            if existing.agent_turn_id == turn_id and existing.request_fingerprint == request_fingerprint:
                if existing.status == CaptureStatus.OPEN:
                    self._hint_open(t, capture_id, reply[1])
                return Reservation(ReserveOutcome.IDEMPOTENT)
            raise Conflict("capture_id already used with different input")
        if code == scripts.INACTIVE:
            raise Conflict("RL Task is not active")
        if code == scripts.TURN_CLOSED:
            raise AbortingConflict(f"turn {turn_id} is closed")
        if code == scripts.TURN_CLOSING:
            raise AbortingConflict(f"turn {turn_id} is closing")
        if code == scripts.TURN_WAITING:
            raise Conflict(f"turn {text(reply[1])} is already waiting for {text(reply[2])}")
        if code == scripts.PUBLISH_CURRENT:
            return Reservation(ReserveOutcome.PUBLISH_CURRENT, current_turn=text(reply[1]))
        self._task_reply(t, reply)

    async def commit(
        self,
        task: Task,
        capture_id: str,
        turn_id: str | None,
        request_fingerprint: str,
        response_fingerprint: str,
        samples: Sequence[PackedSample] | None,
    ) -> bool:
        """open → committed with its staged samples (one, or one per choice of an `n` > 1 answer); returns False for
        an idempotent repeat.

        `samples` may be None only when the caller knows the capture is already committed. Invariants 2 and 3:
        the capture leaves the open set, joins the committed (and turn) set and gains its staged samples at once.

        The staged sample carries `completion_latency_ms` (this commit's time minus the reservation's `created_at`),
        so it is encoded here from the capture metadata the decision is based on, and the script
        (`capture_scripts.COMMIT`) writes only while the stored metadata is still exactly those bytes and the Task
        active: the check WATCH made. The metadata comes from this process's own reservation when it made one (one
        round trip); else the first script call only reads it (two). A commit that finds the capture changed under
        it decides again from what the script returned, as a lost WATCH retried."""
        t = task.rl_task_id
        capture_key = keys.capture(t, capture_id)
        script_keys = [keys.task(t), capture_key, keys.staged(t, capture_id), keys.open_captures(t),
                       keys.committed_captures(t), keys.task_events(t)]
        if turn_id is not None:
            script_keys.append(keys.turn_captures(t, turn_id))
        event: dict[str, Any] = {"capture_id": capture_id, "agent_turn_id": turn_id}
        if samples and samples[0].meta.get("sampling"):
            event["sampling"] = samples[0].meta["sampling"]  # the Task's timeline shows what each capture sampled at
        if samples and len(samples) > 1:
            event["samples"] = len(samples)
        event_data = events.encode_data(event)
        expected = self._open_hints.get((t, capture_id))
        for _ in range(MAX_WATCH_RETRIES):
            args: list[Any] = [task.created_at, b"", b"", b"", capture_id, b"", b""]
            if expected is not None and samples:
                meta = CaptureMeta.from_json(expected)
                if (meta.status == CaptureStatus.OPEN and meta.agent_turn_id == turn_id
                        and meta.request_fingerprint == request_fingerprint):
                    now = now_iso()
                    # Completion latency: from the reservation at `:before` to this commit (per-version evaluation).
                    latency = round(max(0.0, (parse_iso_epoch(now) - parse_iso_epoch(meta.created_at)) * 1000.0), 3)
                    for sample in samples:
                        sample.meta["completion_latency_ms"] = latency
                    committed = CaptureMeta(
                        meta.capture_id, meta.agent_turn_id, meta.request_fingerprint, response_fingerprint,
                        CaptureStatus.COMMITTED, meta.created_at, len(samples) if len(samples) > 1 else None,
                    )
                    args = [task.created_at, expected, committed.to_json(), PackedSample.encode_staged_all(samples),
                            capture_id, now, event_data]
            reply = await self._scripts.commit(keys=script_keys, args=args)
            code = reply[0]
            if code == scripts.DONE:
                self._open_hints.pop((t, capture_id), None)
                self.signals.notify(t)
                log.debug("capture %s of task %s committed", capture_id, t,
                          extra={"rl_task_id": t, "capture_id": capture_id, "agent_turn_id": turn_id})
                return True
            if code != scripts.STATE:
                self._task_reply(t, reply)
            # Not written: decide from the capture as stored, in the order the contract gives (§4.2 after).
            raw, active = reply[1], reply[2] == 1
            if raw is None:
                raise Conflict("capture has no matching before")
            meta = CaptureMeta.from_json(raw)
            if meta.agent_turn_id != turn_id:
                raise Conflict("agent_turn_id differs from the one seen at before")
            if meta.request_fingerprint != request_fingerprint:
                raise Conflict("request differs from the one seen at before")
            if meta.status == CaptureStatus.COMMITTED:
                self._open_hints.pop((t, capture_id), None)
                if meta.response_fingerprint == response_fingerprint:
                    return False
                raise Conflict("capture already committed with a different response")
            if not active:
                raise Conflict("RL Task is not active")
            if not samples:
                raise Conflict("capture is not committed")
            expected = raw  # open, same input, Task active: commit it if it is still exactly this record
        raise RedisContention("commit kept finding its capture changed")

    async def discard(self, rl_task_id: str, capture_id: str, turn_id: str | None) -> bool:
        """Drop an open capture (True when dropped), in one script round trip (`capture_scripts.DISCARD`). Unknown
        capture or inactive Task: no-op. Invariant 2 as in `reserve`."""
        t = rl_task_id
        reply = await self._scripts.discard(
            keys=[keys.task(t), keys.capture(t, capture_id), keys.captures(t), keys.open_captures(t),
                  keys.task_events(t)],
            args=[turn_id or "", capture_id, now_iso(),
                  events.encode_data({"capture_id": capture_id, "agent_turn_id": turn_id})],
        )
        code = reply[0]
        if code == scripts.DONE:
            self._open_hints.pop((t, capture_id), None)
            self.signals.notify(t)
            return True
        if code == scripts.NO_CAPTURE:
            return False
        if code == scripts.COMMITTED:
            raise Conflict("capture is already committed")
        if code == scripts.OTHER_TURN:
            raise Conflict("agent_turn_id differs from the one seen at before")
        self._task_reply(t, reply)

    async def committed_ids(self, rl_task_id: str) -> list[str]:
        return sorted(text(c) for c in await self._redis.smembers(keys.committed_captures(rl_task_id)))

    # ------------------------------------------------------------------ Turns

    async def turn_state(self, rl_task_id: str) -> tuple[str | None, str | None]:
        """(current turn, transition turn)."""
        current, transition = await self._redis.mget(
            keys.turn_current(rl_task_id), keys.turn_transition(rl_task_id)
        )
        return text(current), text(transition)

    async def claim_publish(self, rl_task_id: str, turn_id: str, *, owner: str = "") -> TurnPublication:
        """Claim the publication of a turn for the worker process `owner`. Returns CLAIMED when this caller must
        publish, OPEN when captures are still open (wait and retry), or the existing state (PUBLISHING, PUBLISHED,
        FAILED).

        Invariant 7: only one caller publishes a turn; the claim is taken only while no capture is open, and it
        names its holder in the same EXEC (a claim of a dead holder is taken over with `take_over_publish`)."""
        t = rl_task_id
        task_key, open_key, publish_key = keys.task(t), keys.open_captures(t), keys.turn_publish(t, turn_id)

        async def body(pipe: Pipeline) -> TurnPublication:
            task = await self._read_task(pipe, task_key)
            state = text(await pipe.get(publish_key))
            if state is not None:
                return TurnPublication(state)
            if not task.active:
                raise Conflict("RL Task is not active")
            if await pipe.scard(open_key):
                return TurnPublication.OPEN
            pipe.multi()
            pipe.set(publish_key, TurnPublication.PUBLISHING)
            pipe.set(keys.turn_publisher(t, turn_id), owner)
            events.queue(pipe, keys.task_events(t), "turn_publishing", {"agent_turn_id": turn_id})
            await pipe.execute()
            return TurnPublication.CLAIMED

        state = await transact(self._redis, body, task_key, open_key, publish_key)
        if state == TurnPublication.CLAIMED:
            self.signals.notify(t)
        return state

    async def publisher(self, rl_task_id: str, turn_id: str) -> str | None:
        """The worker process holding the turn's `publishing` claim ("" for a claim from before workers)."""
        return text(await self._redis.get(keys.turn_publisher(rl_task_id, turn_id)))

    async def take_over_publish(self, rl_task_id: str, turn_id: str, *, dead: str | None, owner: str) -> bool:
        """Move a `publishing` claim from the dead holder `dead` to `owner`; False when the claim changed meanwhile
        (another process took it over first, or the publication ended). Invariant 7: one publisher per turn."""
        t = rl_task_id
        publish_key, publisher_key = keys.turn_publish(t, turn_id), keys.turn_publisher(t, turn_id)

        async def body(pipe: Pipeline) -> bool:
            state, holder = await pipe.mget(publish_key, publisher_key)
            if text(state) != TurnPublication.PUBLISHING or text(holder) != dead:
                return False
            pipe.multi()
            pipe.set(publisher_key, owner)
            await pipe.execute()
            return True

        return await transact(self._redis, body, publish_key, publisher_key)

    async def publish_state(self, rl_task_id: str, turn_id: str) -> TurnPublication | None:
        state = text(await self._redis.get(keys.turn_publish(rl_task_id, turn_id)))
        return None if state is None else TurnPublication(state)

    async def turn_capture_ids(self, rl_task_id: str, turn_id: str) -> list[str]:
        return sorted(text(c) or "" for c in await self._redis.smembers(keys.turn_captures(rl_task_id, turn_id)))

    async def turn_staged(self, rl_task_id: str, turn_id: str) -> list[tuple[str, bytes]]:
        """Staged sample blobs of a turn's committed captures, by capture id."""
        t = rl_task_id
        ids = sorted(text(c) for c in await self._redis.smembers(keys.turn_captures(t, turn_id)))
        if not ids:
            return []
        blobs = await self._redis.mget([keys.staged(t, c) for c in ids])
        return [(c, b) for c, b in zip(ids, blobs) if b is not None]

    async def complete_publish(
        self, rl_task_id: str, turn_id: str, capture_ids: list[str], *, reward: float | None = None, owner: str = "",
        sample_count: int | None = None,
    ) -> None:
        """publishing → published: the turn joins the closed set and its staged samples go, atomically, only while
        the Task is active and this publication (`owner`) still holds the claim. Invariants 3 and 7. `reward` (the
        turn's mean Judge score) goes into the `turn_published` event so a timeline shows what the turn earned, with
        `sample_count` (the turn's samples; its captures when not given)."""
        t = rl_task_id
        task_key, publish_key = keys.task(t), keys.turn_publish(t, turn_id)
        turn_set, publisher_key = keys.turn_captures(t, turn_id), keys.turn_publisher(t, turn_id)

        async def body(pipe: Pipeline) -> None:
            task = await self._read_task(pipe, task_key)
            if not task.active:
                raise Conflict("RL Task was aborted during turn publication")
            state, holder = await pipe.mget(publish_key, publisher_key)
            # Only `publishing` may become `published`, and only by the process holding the claim (another one
            # took it over when this one was thought dead).
            if not TURN_PUBLICATION_TRANSITIONS.allows(text(state), TurnPublication.PUBLISHED) or \
                    (holder is not None and text(holder) != owner):
                raise Conflict("turn publication lost its claim")
            pipe.multi()
            pipe.set(publish_key, TurnPublication.PUBLISHED)
            pipe.delete(keys.turn_publisher(t, turn_id))
            pipe.sadd(keys.turns_closed(t), turn_id)
            if capture_ids:
                pipe.delete(*(keys.staged(t, c) for c in capture_ids))
            data: dict[str, Any] = {"agent_turn_id": turn_id,
                                    "samples": len(capture_ids) if sample_count is None else sample_count}
            if reward is not None:
                data["reward"] = reward
            events.queue(pipe, keys.task_events(t), "turn_published", data)
            await pipe.execute()

        await transact(self._redis, body, task_key, publish_key, turn_set, publisher_key)
        self.signals.notify(t)

    async def fail_publish(self, rl_task_id: str, turn_id: str, *, fence: Fence = UNFENCED) -> None:
        t = rl_task_id

        def queue(pipe: Pipeline) -> None:  # the state, its holder and its event together
            pipe.set(keys.turn_publish(t, turn_id), TurnPublication.FAILED)
            pipe.delete(keys.turn_publisher(t, turn_id))
            events.queue(pipe, keys.task_events(t), "turn_failed", {"agent_turn_id": turn_id})

        await fence.write(self._redis, queue)
        self.signals.notify(t)

    async def advance_turn(self, rl_task_id: str, from_turn: str, to_turn: str) -> None:
        """current C (published) → T, transition cleared. Idempotent: a second caller finds current = T.
        Invariant 7: current only moves forward after its predecessor is published."""
        t = rl_task_id
        current_key, transition_key = keys.turn_current(t), keys.turn_transition(t)
        publish_key = keys.turn_publish(t, from_turn)

        async def body(pipe: Pipeline) -> None:
            current = text(await pipe.get(current_key))
            if current != from_turn:
                return
            if text(await pipe.get(publish_key)) != TurnPublication.PUBLISHED:
                raise Conflict(f"turn {from_turn} is not published")
            transition = text(await pipe.get(transition_key))
            pipe.multi()
            pipe.set(current_key, to_turn)
            if transition == to_turn:
                pipe.delete(transition_key)
            await pipe.execute()

        await transact(self._redis, body, current_key, transition_key, publish_key)
        self.signals.notify(t)

    # -------------------------------------------------------------- internals

    @staticmethod
    async def _read_task(pipe: Pipeline, task_key: str) -> Task:
        raw = await pipe.get(task_key)
        if raw is None:
            raise NotFound("RL Task not found")
        return Task.from_json(raw)
