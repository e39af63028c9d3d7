"""The lineage registry (`rl:v1:lineages`, docs/lineages.md): which lineages exist, and a page of them with their
line's pending count and active run (`GET /v1/rl/lineages`).

`default` always exists and is never in the ZSET; every other lineage is added by the start EXEC of its first Task
(tasks/registry.py) and removed only by the last step of its deletion (lineage_purge.py). A page costs one ZRANGE,
one read of the live runs (the pointers and at most `max_concurrent_runs` records) and pipelined reads per item
(first use, pending count, lifecycle state): never a read of every lineage.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from ..common.ids import epoch_iso
from ..common.lineage import DEFAULT_LINEAGE, is_lineage, line_of
from .errors import InvalidInput
from .lineage_state import LineageStatus, parse_state
from .store import keys
from .store.codec import text
from .store.listing import newest_first
from .store.sample_status import SampleStatus
from .training.run_reads import RunReads

_SCOPE = "lineages"


class LineageRegistry:
    def __init__(self, redis: Redis, *, model_id: str, runs: RunReads) -> None:
        self._redis = redis
        self._model_id = model_id
        self._runs = runs

    async def exists(self, lineage: str) -> bool:
        """`default`, or a registered lineage; False for anything that is not a lineage name."""
        if not is_lineage(lineage):
            return False
        return lineage == DEFAULT_LINEAGE or await self._redis.zscore(keys.LINEAGES, lineage) is not None

    async def status(self, lineage: str) -> LineageStatus | None:
        """The lifecycle state of `default` (live) or a registered lineage; None when it does not exist."""
        if not await self.exists(lineage):
            return None
        if lineage == DEFAULT_LINEAGE:
            return LineageStatus.LIVE
        state = parse_state(await self._redis.get(keys.lineage_state(lineage)))
        return LineageStatus.LIVE if state is None else state.status

    async def page(self, *, limit: int, cursor: str | None) -> dict[str, Any]:
        """Registered lineages newest first (by first use), with their line, pending samples and active run."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise InvalidInput("invalid_request", "limit must be an integer between 1 and 1000")
        names, next_cursor = await newest_first(self._redis, keys.LINEAGES, limit=limit, cursor=cursor, scope=_SCOPE)
        names = [name for name in names if is_lineage(name)]  # only ever written by the Task start
        lines = [line_of(self._model_id, name) for name in names]
        async with self._redis.pipeline(transaction=False) as reads:
            for name, line in zip(names, lines):
                reads.zscore(keys.LINEAGES, name)
                reads.hget(keys.traj_stats(line), keys.stats_status(SampleStatus.PENDING))
                reads.get(keys.lineage_state(name))
            raw = await reads.execute()
        active = {run.lineage: run.training_run_id for run in await self._runs.active_runs()}
        items = []
        for i, (name, line) in enumerate(zip(names, lines)):
            first_used, pending, state = raw[3 * i:3 * i + 3]
            lifecycle = parse_state(state)
            items.append({
                "lineage": name,
                "line": line,
                "first_used_at": None if first_used is None else epoch_iso(first_used),
                "pending_samples": max(0, int(text(pending) or 0)),
                "active_run": active.get(name),
                "state": (lifecycle.status if lifecycle is not None else LineageStatus.LIVE).value,
            })
        return {"items": items, "next_cursor": next_cursor}
