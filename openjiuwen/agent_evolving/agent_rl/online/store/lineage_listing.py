"""The per-lineage listing indexes of Tasks and Training Runs (docs/lineages.md "Listings per lineage").

The overall creation indexes (`tasks:by_created`, `training_runs:by_created`) hold every lineage's ids, so
`?lineage=` reads a lineage's own index instead: a page costs O(page), whatever the other lineages hold. Writers
queue these entries into the same MULTI as the overall ones (the callers name the invariant); this module only knows
the keys and how an id leaves them once its record has expired.

When a record gets its TTL, a non-default lineage is remembered in a HASH id → lineage beside the listing-expiry
entry (no field = `default`, so the default lineage costs nothing there): the sweeper that trims the listings
finds the record gone and still knows which lineage index holds the id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common.lineage import DEFAULT_LINEAGE, is_lineage
from ...common.wire.task_states import TASK_STATUSES
from . import keys
from .codec import text


@dataclass(frozen=True, slots=True)
class LineageListing:
    """One kind of record's per-lineage indexes: Tasks (with a status index per lineage) or Training Runs."""

    by_lineage: Callable[[str], str]  # the lineage's creation index
    lineage_of_expiring: str  # HASH id → non-default lineage of a record with a TTL
    statuses: tuple[str, ...] = ()  # Tasks: the per-lineage status indexes

    def index(self, lineage: str, status: str | None = None) -> str:
        if status is None:
            return self.by_lineage(lineage)
        return keys.tasks_by_lineage_status(lineage, status)

    def queue_expiring(self, pipe: Pipeline, member: str, lineage: str) -> None:
        """Queue, with the record's TTL and listing-expiry entry, the lineage the trimming will need."""
        if lineage != DEFAULT_LINEAGE:
            pipe.hset(self.lineage_of_expiring, member, lineage)

    async def lineages_of(self, redis: Redis, members: Sequence[str]) -> list[str]:
        """The lineage of each expiring member (`default` when none is recorded: before the upgrade, or default)."""
        if not members:
            return []
        raw = await redis.hmget(self.lineage_of_expiring, list(members))
        out = []
        for value in raw:
            lineage = text(value)
            out.append(lineage if lineage is not None and is_lineage(lineage) else DEFAULT_LINEAGE)
        return out

    def queue_forget(self, pipe: Pipeline, members: Sequence[str], lineages: Sequence[str]) -> None:
        """Queue the removal of gone records' ids from their lineage's indexes and of their HASH fields."""
        if not members:
            return
        by_lineage: dict[str, list[str]] = {}
        for member, lineage in zip(members, lineages):
            by_lineage.setdefault(lineage, []).append(member)
        for lineage, ids in by_lineage.items():
            pipe.zrem(self.index(lineage), *ids)
            for status in self.statuses:
                pipe.zrem(self.index(lineage, status), *ids)
        pipe.hdel(self.lineage_of_expiring, *members)


TASK_LISTING = LineageListing(keys.tasks_by_lineage, keys.TASKS_LISTING_LINEAGE, tuple(TASK_STATUSES))
RUN_LISTING = LineageListing(keys.runs_by_lineage, keys.RUNS_LISTING_LINEAGE)
