"""Reads of Training Runs: a record, the live runs named by the pointers, the newest-first listing, a timeline. Any
worker reads; the listing's removal of expired ids (any worker's `GET`) is the one write, not fenced."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from .. import events
from ..store import keys
from ..store.codec import text
from ..store.lineage_listing import RUN_LISTING
from ..store.listing import newest_first
from .run_records import TrainingRun


class RunReads:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    async def get(self, run_id: str) -> TrainingRun | None:
        raw = await self._redis.get(keys.training_run(run_id))
        return None if raw is None else TrainingRun.from_json(raw)

    async def active_runs(self) -> list[TrainingRun]:
        """Every live run, named by the pointers (one consistent read of both, then their records)."""
        async with self._redis.pipeline(transaction=True) as reads:
            reads.get(keys.ACTIVE_RUN)
            reads.hgetall(keys.ACTIVE_LINEAGE_RUNS)
            default_id, others = await reads.execute()
        run_ids = list(dict.fromkeys(r for r in (text(default_id), *(text(v) for v in others.values())) if r))
        raws = await self._redis.mget([keys.training_run(r) for r in run_ids]) if run_ids else []
        runs = (TrainingRun.from_json(raw) for raw in raws if raw is not None)
        return [run for run in runs if not run.terminal]

    async def active_of(self, lineage: str) -> TrainingRun | None:
        """The live run of `lineage`, None when it has none."""
        return next((run for run in await self.active_runs() if run.lineage == lineage), None)

    async def list_page(self, limit: int, cursor: str | None, lineage: str | None = None) -> dict[str, Any]:
        """Public run records newest first (`GET /v1/rl/training/runs`); with `lineage`, from that lineage's own
        index (O(page)). Ids of expired records leave the indexes."""
        index, scope = ((keys.RUNS_BY_CREATION, "runs") if lineage is None
                        else (RUN_LISTING.index(lineage), f"runs/{lineage}"))
        ids, next_cursor = await newest_first(self._redis, index, limit=limit, cursor=cursor, scope=scope)
        raws = await self._redis.mget([keys.training_run(r) for r in ids]) if ids else []
        gone = [r for r, raw in zip(ids, raws) if raw is None]
        if gone:
            lineages = ([lineage] * len(gone) if lineage is not None
                        else await RUN_LISTING.lineages_of(self._redis, gone))
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zrem(keys.RUNS_BY_CREATION, *gone)
                pipe.zrem(keys.RUNS_LISTING_EXPIRY, *gone)
                RUN_LISTING.queue_forget(pipe, gone, lineages)
                await pipe.execute()
        runs = [TrainingRun.from_json(raw) for raw in raws if raw is not None]
        items = [run.public() for run in runs if lineage is None or run.lineage == lineage]
        return {"items": items, "next_cursor": next_cursor}

    async def events(self, run_id: str) -> list[dict[str, Any]] | None:
        """The run timeline oldest first, or None for an unknown run."""
        if not await self._redis.exists(keys.training_run(run_id)):
            return None
        return await events.EventLog(self._redis).read(keys.training_run_events(run_id))
