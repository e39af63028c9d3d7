"""Mutating LoRA operations run as asyncio tasks shielded from the caller's cancellation: a client that goes away cannot
split "loaded everywhere" from "persisted and switched"."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from .lora_types import LoraError

T = TypeVar("T")


class ShieldedOperations:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    async def run(self, coro: Coroutine[Any, Any, T], name: str) -> T:
        """Run `coro` as an owned task that the caller's cancellation does not interrupt; 503 once closed."""
        if self.closed:
            coro.close()
            raise LoraError("gateway_closing", "the LoRA manager is closed")
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def close(self) -> None:
        """Cancel and await the operations still running. Idempotent."""
        self.closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
