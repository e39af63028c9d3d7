"""Locks of the LoRA operations, each waited for until a deadline only.

Order is always the line's lock (policy_lines.py), then a version's lock: a version lock serializes every load and
unload of that version, so an unload never races a load of the same name.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from .lora_types import LoraError


@contextlib.asynccontextmanager
async def holding(lock: asyncio.Lock, deadline: float) -> AsyncIterator[bool]:
    """Hold `lock` if it can be taken before `deadline`; yields whether it was."""
    acquired = False
    try:
        async with asyncio.timeout_at(deadline):
            await lock.acquire()
        acquired = True
    except TimeoutError:
        pass
    try:
        yield acquired
    finally:
        if acquired:
            lock.release()


class VersionLocks:
    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    def of(self, lora_name: str) -> asyncio.Lock:
        lock = self._locks.get(lora_name)
        if lock is None:
            lock = self._locks[lora_name] = asyncio.Lock()
        return lock

    @contextlib.asynccontextmanager
    async def loading(self, lora_name: str, deadline: float) -> AsyncIterator[None]:
        """Hold a version's lock to load it as active or candidate; 502 when it is busy past `deadline`."""
        async with holding(self.of(lora_name), deadline) as held:
            if not held:
                raise LoraError("lora_activation_failed", f"an operation on {lora_name} is still running")
            yield
