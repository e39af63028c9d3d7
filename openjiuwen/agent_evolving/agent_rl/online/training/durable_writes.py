"""A Training Run's own state writes, retried through a Redis outage: shared by its execution (run_executions.py) and
its activation (run_activation.py), so that an execution that met a blip never leaves its run non-terminal with its
batch claimed until a restart."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("openjiuwen.agent_rl.online.training")

T = TypeVar("T")
# A run's own state writes outlive a Redis outage of up to this long (then the execution fails for good and health
# reports it); the backoff between tries doubles from 0.1 s up to 2 s.
REDIS_OUTAGE_S = 600.0
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)


class DurableWrites:
    """`await durable(what, write)`: one state write of a run's execution, retried while Redis is unreachable."""

    def __init__(self, outage_s: float = REDIS_OUTAGE_S) -> None:
        self._outage_s = outage_s

    async def __call__(self, what: str, write: Callable[[], Awaitable[T]]) -> T:
        """Every write it wraps is idempotent (a terminal record is returned unchanged, a repeated move finds nothing
        left to move), so a try that Redis applied although its answer was lost is harmless to repeat."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._outage_s
        delay = 0.1
        while True:
            try:
                return await write()
            except REDIS_DOWN as exc:
                if loop.time() + delay > deadline:
                    raise
                log.warning("%s: Redis unavailable (%s); retrying in %.1f s", what, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
