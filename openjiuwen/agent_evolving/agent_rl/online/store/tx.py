"""Optimistic Redis transactions: WATCH → read → decide → MULTI/EXEC, retried on WatchError."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

T = TypeVar("T")

MAX_WATCH_RETRIES = 64


class RedisContention(RuntimeError):
    """A transaction kept losing its WATCH; the caller sees a transient failure."""


async def transact(redis: Redis, body: Callable[[Pipeline], Awaitable[T]], *watch: str) -> T:
    """Run `body(pipe)` with `watch` keys watched; `body` reads in immediate mode, calls `pipe.multi()`, queues
    writes and executes. A WatchError (another writer touched a watched key) reruns it from the start."""
    for attempt in range(MAX_WATCH_RETRIES):
        async with redis.pipeline(transaction=True) as pipe:
            try:
                if watch:
                    await pipe.watch(*watch)
                return await body(pipe)
            except WatchError:
                # Small jittered pause so that converging writers (e.g. concurrent starts) do not spin in lockstep.
                await asyncio.sleep(random.uniform(0, 0.002 * min(attempt + 1, 10)))
    raise RedisContention("transaction kept losing its WATCH")
