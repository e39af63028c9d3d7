"""Rollout records in Redis (docs/rollout.md; CONTRACT §5.2 ext); the record's type is record.py's `Rollout`.

A rollout is a canary of a new version (`kind: canary`) or an operator's activation of a version
(`kind: activation`). Statuses: canary `running` | `paused` → `promoting` | `rolling_back` → `promoted` |
`rolled_back`; activation `activating` → `activated` | `failed`. The intermediate `promoting` / `rolling_back` /
`activating` is written before the gateway call, so a restart finishes the call it was making.

Rollouts are per line (docs/lineages.md): a record of a non-default lineage carries `lineage` (the default line's
records are unchanged), and each line has its own pointer (`keys.rollout_current(lineage)`: `rollout:current` for the
default line). Invariant 10, per line: the line's pointer names exactly the one rollout of that line not ended; every
transition in and out of the ended states changes the record, the pointer (and, for a non-default line, its
membership of `rollouts:live_lineages`) and the timeline(s) in one MULTI. Only the leader changes rollouts: every
write goes through its fence (store/fence.py) and raises LeaseLost once its term is over.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from .. import events
from ..errors import Conflict, NotFound
from ...common.lineage import DEFAULT_LINEAGE
from ...common.ids import is_run_id, now_iso, parse_iso_epoch
from ..lineage_state import require_live
from ..store import keys
from ..store.codec import text
from ..store.fence import Fence
from .record import Rollout
from .status import ROLLOUT_TRANSITIONS

RUN_EVENTS = ("canary_started", "canary_promoted", "canary_rolled_back")


def rollout_id_for_run(run_id: str) -> str:
    """A run's canary has a fixed id, so a restart that repeats the start finds it instead of making another."""
    return "ro-" + run_id.removeprefix("run-")


def new_rollout_id() -> str:
    return "ro-" + secrets.token_hex(6)


class RolloutStore:
    def __init__(self, redis: Redis, *, fence: Fence) -> None:
        self._redis = redis
        self._fence = fence
        self._events = events.EventLog(redis)

    async def current(self, lineage: str = DEFAULT_LINEAGE) -> Rollout | None:
        """The line's rollout not ended, if any."""
        pointer = await self._redis.get(keys.rollout_current(lineage))
        return await self.get(text(pointer)) if pointer is not None else None

    async def live_lineages(self) -> list[str]:
        """The non-default lineages whose line has a rollout not ended (sorted, so rounds visit them in order)."""
        return sorted(text(m) for m in await self._redis.smembers(keys.ROLLOUT_LIVE_LINEAGES))

    async def get(self, rollout_id: str | None) -> Rollout | None:
        if not rollout_id:
            return None
        raw = await self._redis.get(keys.rollout(rollout_id))
        return Rollout.from_json(raw) if raw is not None else None

    async def list_recent(self, limit: int = 20) -> list[Rollout]:
        ids = [text(i) for i in await self._redis.zrevrange(keys.ROLLOUTS_BY_CREATION, 0, limit - 1)]
        raws = await self._redis.mget([keys.rollout(i) for i in ids]) if ids else []
        return [Rollout.from_json(r) for r in raws if r is not None]

    async def events(self, rollout_id: str) -> list[dict[str, Any]]:
        if await self._redis.exists(keys.rollout(rollout_id)) == 0:
            raise NotFound("rollout not found")
        return await self._events.read(keys.rollout_events(rollout_id))

    async def create(self, record: Rollout, event: str, data: dict[str, Any]) -> Rollout:
        """Store a new live rollout and make it current; the same id again returns the stored record (a repeated
        start). Another live rollout of the same line → Conflict `rollout_in_progress`."""
        rollout_id = record.rollout_id
        key = keys.rollout(rollout_id)
        lineage = record.lineage
        current_key = keys.rollout_current(lineage)

        async def body(pipe: Pipeline) -> Rollout:
            existing = await pipe.get(key)
            if existing is not None:
                return Rollout.from_json(existing)
            pointer = await pipe.get(current_key)
            if pointer is not None:
                raise Conflict(f"rollout {text(pointer)} is in progress", code="rollout_in_progress")
            # No version of an archived lineage (or one being deleted) goes live: its state is WATCHed, and the
            # archive WATCHes this line's pointer in turn.
            await require_live(pipe, lineage)
            pipe.multi()
            # Invariant 10 (per line): the record, the line's pointer, the live-line set, the listing and the
            # timelines in one step.
            pipe.set(key, record.to_json())
            pipe.set(current_key, rollout_id)
            if lineage != DEFAULT_LINEAGE:
                pipe.sadd(keys.ROLLOUT_LIVE_LINEAGES, lineage)
            pipe.zadd(keys.ROLLOUTS_BY_CREATION, {rollout_id: parse_iso_epoch(record.created_at)})
            self._queue_events(pipe, record, event, data)
            await pipe.execute()
            return record

        return await self._fence.transact(self._redis, body, key, current_key)

    async def update(self, rollout_id: str, change: Callable[[Rollout], Rollout | None],
                     event: str | None = None, data: dict[str, Any] | None = None) -> Rollout:
        """Apply `change` to a live record (None: leave it); reaching an ended status also clears the line's
        pointer. An ended record is returned unchanged (transitions out of an end never happen)."""
        key = keys.rollout(rollout_id)
        # A record's lineage never changes, so its pointer key can be chosen before the transaction watches it.
        raw = await self._redis.get(key)
        if raw is None:
            raise NotFound("rollout not found")
        lineage = Rollout.from_json(raw).lineage
        current_key = keys.rollout_current(lineage)

        async def body(pipe: Pipeline) -> Rollout:
            raw = await pipe.get(key)
            if raw is None:
                raise NotFound("rollout not found")
            record = Rollout.from_json(raw)
            if record.ended:
                return record
            changed = change(record)
            if changed is None:
                return record
            if changed.status != record.status:
                ROLLOUT_TRANSITIONS.check(record.status, changed.status)  # raises on a move the table lacks
            if changed.lineage != lineage:  # fail closed: a change never moves a rollout to another line
                raise RuntimeError(f"rollout {rollout_id}: a change may not move it to another lineage")
            pointer = await pipe.get(current_key)
            ended = changed.ended
            if ended:
                changed = changed.evolve(ended_at=changed.ended_at or now_iso())
            pipe.multi()
            pipe.set(key, changed.to_json())
            # Invariant 10 (per line): the rollout ends and stops being its line's current one (and the line
            # leaves the live-line set) in the same step.
            if ended and pointer is not None and text(pointer) == rollout_id:
                pipe.delete(current_key)
                if lineage != DEFAULT_LINEAGE:
                    pipe.srem(keys.ROLLOUT_LIVE_LINEAGES, lineage)
            if event is not None:
                self._queue_events(pipe, changed, event, data or {})
            await pipe.execute()
            return changed

        return await self._fence.transact(self._redis, body, key, current_key)

    @staticmethod
    def _queue_events(pipe: Pipeline, record: Rollout, event: str, data: dict[str, Any]) -> None:
        events.queue(pipe, keys.rollout_events(record.rollout_id), event, data)
        run_id = record.training_run_id
        if event in RUN_EVENTS and is_run_id(run_id):  # the run's timeline tells what became of its version
            events.queue(pipe, keys.training_run_events(run_id), event, {"rollout_id": record.rollout_id, **data})
