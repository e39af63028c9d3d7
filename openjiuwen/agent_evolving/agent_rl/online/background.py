"""Stopping the service's background loops (retention and reward-deadline sweepers)."""

from __future__ import annotations

import asyncio
from contextlib import suppress


async def stop_loop(task: asyncio.Task[None] | None, stopping: asyncio.Event) -> None:
    """Stop a loop that checks `stopping` between rounds. The event ends it even where the cancellation does not:
    redis-py can swallow a cancellation that lands inside a command, and the loop would then go on."""
    if task is None:
        return
    stopping.set()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
