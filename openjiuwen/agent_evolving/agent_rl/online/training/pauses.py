"""Operator pauses of automatic training, per lineage (`POST /v1/rl/lineages/{lineage}/pause|resume`).

One HASH field per paused lineage (`keys.LINEAGES_PAUSED`), so a pause survives restarts and leader changes and
every worker reads the same answer. Single-key writes: no transaction needed.
"""

from __future__ import annotations

from typing import Any

import orjson
from redis.asyncio import Redis

from ...common.ids import now_iso
from ..store import keys


class LineagePauses:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    async def pause(self, lineage: str) -> dict[str, Any]:
        """Pause (idempotent: a second pause keeps the first time)."""
        record = {"paused_at": now_iso()}
        await self._redis.hsetnx(keys.LINEAGES_PAUSED, lineage, orjson.dumps(record))
        return await self.get(lineage) or record

    async def resume(self, lineage: str) -> None:
        await self._redis.hdel(keys.LINEAGES_PAUSED, lineage)

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
