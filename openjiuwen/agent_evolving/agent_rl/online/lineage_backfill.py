"""One-time indexing of the Tasks and Training Runs listed before the per-lineage listing indexes existed
(docs/lineages.md "Listings per lineage").

Since the upgrade every writer files a new id in its lineage's index in the same EXEC as the overall index; the ids
already listed then are indexed here once, by the leader at its start (`take_office`), before its loops: the
overall index is walked newest first a chunk at a time, each chunk in one fenced transaction that WATCHes the
chunk's records (a Task whose status moves meanwhile is read again, never filed under a status it left) and the
progress marker, which the same EXEC advances. A new leader resumes where a deposed one stopped; once the marker
says `done` a start costs one GET. Re-indexing an id a writer already filed is a no-op (same member, same score).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ..common.ids import parse_iso_epoch
from .tasks.task_records import Task
from .training.run_records import TrainingRun
from .store.fence import Fence
from .store import keys
from .store.lineage_listing import RUN_LISTING, TASK_LISTING
from .store.listing import newest_first

log = logging.getLogger("openjiuwen.agent_rl.online.listings")

CHUNK = 500
_DONE = b"done"
_PHASES = ("tasks", "runs")


class ListingBackfill:
    def __init__(self, redis: Redis, *, fence: Fence, chunk: int = CHUNK) -> None:
        self._redis = redis
        self._fence = fence
        self._chunk = chunk

    async def run(self) -> int:
        """Index every id listed before the upgrade; returns how many ids it read (0 once done)."""
        total = 0
        while True:
            raw = await self._redis.get(keys.LISTINGS_LINEAGE_BACKFILL)
            if raw == _DONE:
                if total:
                    log.info("listings per lineage: %d listed ids indexed", total)
                return total
            state = orjson.loads(raw) if raw else {"phase": "tasks", "cursor": None}
            total += await self._fence.transact(
                self._redis, lambda pipe, s=state: self._step(pipe, s), keys.LISTINGS_LINEAGE_BACKFILL)

    async def _step(self, pipe: Pipeline, state: dict) -> int:
        phase, cursor = state["phase"], state["cursor"]
        tasks = phase == "tasks"
        overall, scope = (keys.TASKS_BY_CREATION, "backfill-tasks") if tasks else (keys.RUNS_BY_CREATION, "backfill-runs")
        ids, next_cursor = await newest_first(pipe, overall, limit=self._chunk, cursor=cursor, scope=scope)
        record_keys = [keys.task(i) if tasks else keys.training_run(i) for i in ids]
        if record_keys:
            await pipe.watch(*record_keys)  # a record that changes before the EXEC makes the chunk run again
        raws = await pipe.mget(record_keys) if record_keys else []
        if next_cursor is not None:
            marker = orjson.dumps({"phase": phase, "cursor": next_cursor})
        else:
            following = _PHASES.index(phase) + 1
            marker = orjson.dumps({"phase": _PHASES[following], "cursor": None}) if following < len(_PHASES) else _DONE
        records = [_parse(raw, Task if tasks else TrainingRun) for raw in raws]
        pipe.multi()
        for record in records:
            if record is None:
                continue  # expired (the listings drop it on their own) or unreadable (never fail a leader start)
            if tasks:
                task = record
                created = parse_iso_epoch(task.created_at)
                pipe.zadd(TASK_LISTING.index(task.lineage), {task.rl_task_id: created})
                pipe.zadd(TASK_LISTING.index(task.lineage, task.status), {task.rl_task_id: created})
                TASK_LISTING.queue_expiring(pipe, task.rl_task_id, task.lineage)
            else:
                run = record
                pipe.zadd(RUN_LISTING.index(run.lineage), {run.training_run_id: parse_iso_epoch(run.created_at)})
                RUN_LISTING.queue_expiring(pipe, run.training_run_id, run.lineage)
        # The progress moves with the chunk it covers (invariant: every id before the marker is indexed).
        pipe.set(keys.LISTINGS_LINEAGE_BACKFILL, marker)
        await pipe.execute()
        return len(ids)


def _parse(raw: bytes | None, kind: type) -> Any:
    if raw is None:
        return None
    try:
        return kind.from_json(raw)
    except (ValueError, TypeError, KeyError):
        log.warning("listings per lineage: an unreadable %s record is left unindexed", kind.__name__)
        return None
