"""The reward-deadline sweeper: moves `awaiting_rewards` samples whose source deadlines passed.

Each tick takes at most `batch` due samples from the deadline index (ZRANGEBYSCORE … LIMIT) and moves each in its
own transaction (`RewardLedger.sweep_due`). Between ticks it sleeps until the earliest known deadline, but never
longer than `interval_s` (deadlines of samples published by other processes) and never shorter than `_MIN_SLEEP_S`
unless the last tick was full: no busy loop. Several processes may sweep at once; a crash between two moves leaves
every sample either moved or still due, and the next sweep (at startup or on the next tick) finishes the work.
A leader duty: every move goes through the leader's fence (store/fence.py); a refused one (LeaseLost) ends the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress

from ..background import stop_loop
from ..store.fence import Fence, LeaseLost
from .ledger import RewardLedger, SweepResult

log = logging.getLogger("openjiuwen.agent_rl.online.rewards")

BATCH = 500
_MIN_SLEEP_S = 0.05


class RewardDeadlineSweeper:
    def __init__(self, ledger: RewardLedger, *, fence: Fence, interval_s: float, batch: int = BATCH) -> None:
        self._ledger = ledger
        self._fence = fence
        self._interval_s = interval_s
        self._batch = batch
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def sweep_once(self, *, now: float | None = None) -> SweepResult:
        result = await self._ledger.sweep_due(fence=self._fence, now=now, limit=self._batch)
        if result.visited:
            log.info(
                "reward deadlines: %d sample(s) visited, %d released, %d dropped, %d fallback(s)",
                result.visited, result.released, result.dropped, result.fallbacks,
            )
        return result

    async def _delay(self, result: SweepResult) -> float:
        if result.visited >= self._batch:
            return 0.0  # more are due: go on at once, one bounded batch per tick
        next_at = await self._ledger.next_deadline()
        if next_at is None:
            return self._interval_s
        return min(self._interval_s, max(_MIN_SLEEP_S, next_at - time.time()))

    # ------------------------------------------------------------ background

    def start(self) -> None:
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="reward-deadline-sweeper")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        # The stop event, not only the cancellation, ends the loop: redis-py (8.1 here) can swallow a cancellation
        # that lands inside a command, which would otherwise leave stop() awaiting a loop that never ends.
        while not self._stopping.is_set():
            try:
                delay = await self._delay(await self.sweep_once())
            except asyncio.CancelledError:
                raise
            except LeaseLost as exc:  # deposed: the next leader sweeps
                log.warning("reward deadline sweeps stop: %s", exc)
                return
            except Exception:
                log.exception("reward deadline sweep failed; retrying in %.1f s", self._interval_s)
                delay = self._interval_s
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def stop(self) -> None:
        await stop_loop(self._task, self._stopping)
        self._task = None
