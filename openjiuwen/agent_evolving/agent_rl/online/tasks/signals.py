"""In-process wake-ups for waits on a Task's state (open captures drained, a turn published, an abort).

Waiters also re-check at least every second, so a change made by another service process is seen too.
"""

from __future__ import annotations

import asyncio


class TaskSignals:
    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def notify(self, rl_task_id: str) -> None:
        event = self._events.pop(rl_task_id, None)
        if event is not None:
            event.set()

    async def wait(self, rl_task_id: str, timeout_s: float) -> None:
        """Return on the next notification for the Task, or after `timeout_s` (capped at 1 s), whichever first."""
        event = self._events.get(rl_task_id)
        if event is None:
            event = self._events[rl_task_id] = asyncio.Event()
        try:
            await asyncio.wait_for(event.wait(), timeout=max(0.0, min(timeout_s, 1.0)))
        except TimeoutError:
            pass
