"""Operator pauses of automatic training, per lineage (`POST /v1/rl/lineages/{lineage}/pause|resume`).

One HASH field per paused lineage (`keys.LINEAGES_PAUSED`), so a pause survives restarts and leader changes and
every worker reads the same answer. A pause is one write; a resume also makes the lineage's line due for the
scheduler's judgement (`keys.TRAINING_WAITING`), which forgets a paused line until then.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from redis.asyncio import Redis

from ...common.ids import now_iso
from ...common.lineage import DEFAULT_LINEAGE, line_of
from ..store import keys


class LineagePauses:
    def __init__(self, redis: Redis, *, model_id: str) -> None:
        self._redis = redis
        self._model_id = model_id

    async def pause(self, lineage: str) -> dict[str, Any]:
        """Pause (idempotent: a second pause keeps the first time)."""
        record = {"paused_at": now_iso()}
        await self._redis.hsetnx(keys.LINEAGES_PAUSED, lineage, orjson.dumps(record))
        return await self.get(lineage) or record

    async def resume(self, lineage: str) -> None:
        async with self._redis.pipeline(transaction=True) as tx:
            tx.hdel(keys.LINEAGES_PAUSED, lineage)
            if lineage != DEFAULT_LINEAGE:
                # Invariant (keys.TRAINING_WAITING): a line the scheduler dropped while paused is due again, in the
                # EXEC that ends the pause, so it can never be resumed and forgotten.
                tx.zadd(keys.TRAINING_WAITING, {line_of(self._model_id, lineage): time.time()}, lt=True)
            await tx.execute()

    async def get(self, lineage: str) -> dict[str, Any] | None:
        raw = await self._redis.hget(keys.LINEAGES_PAUSED, lineage)
        if raw is None:
            return None
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            record = None
        # A field that is not ours to read still means paused: the guard fails closed.
        return record if isinstance(record, dict) else {"paused_at": None}
