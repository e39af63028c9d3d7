"""Which worker processes of the RL Service are alive, so that a claim left by a dead one can be taken over.

Claims that outlive a request (a delayed turn's publication, rail samples being judged) name the process that holds
them (`member`, `<boot>:<slot>:<pid>`). Another process takes such a claim over only when its holder is not alive:
it belongs to an earlier boot, or its heartbeat entry in `keys.WORKERS` expired or was removed by the process that
replaced it in its slot. A lone service (`workers: 1`) has no other process: every claim it finds and does not
hold in memory is left from a crash.
"""

from __future__ import annotations

import os
import time

from redis.asyncio import Redis

from ..store import keys


class Membership:
    def __init__(self, redis: Redis | None, *, boot: str = "solo", slot: int = 0, solo: bool = True) -> None:
        self._redis = redis
        self.boot = boot
        self.slot = slot
        self.solo = solo
        self.member = f"{boot}:{slot}:{os.getpid()}"

    async def alive(self, member: str | None) -> bool:
        """Whether `member` is another live process of this boot. This process itself counts as not alive: a
        claim of its own that it finds in Redis but not in memory is left from a failed roll-back."""
        if member is None or self.solo or self._redis is None or member == self.member:
            return False
        if not member.startswith(f"{self.boot}:"):
            return False
        score = await self._redis.zscore(keys.WORKERS, member)
        return score is not None and score > time.time() * 1000

    async def members(self, *, live_only: bool = False) -> list[str]:
        """The members of this boot in the heartbeat set; with `live_only`, those whose entry has not expired."""
        if self._redis is None:
            return [self.member]
        prefix = f"{self.boot}:"
        low = time.time() * 1000 if live_only else "-inf"
        return [m.decode() for m in await self._redis.zrangebyscore(keys.WORKERS, low, "+inf")
                if m.decode().startswith(prefix)]

    async def forget_predecessors(self) -> None:
        """An earlier process of this slot is dead (the group restarts a slot only after reaping it): its claims
        must not look alive until its entry expires."""
        if self._redis is None:
            return
        slot = f"{self.boot}:{self.slot}:"
        stale = [m for m in await self.members() if m.startswith(slot) and m != self.member]
        if stale:
            await self._redis.zrem(keys.WORKERS, *stale)


SOLO = Membership(None)
