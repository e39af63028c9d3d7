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
    """One lock per version name, kept only while someone holds or waits for it: a gateway that sees thousands of
    versions come and go keeps no lock of a version nobody touches (issue 37 item 8)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # name → (lock, holders and waiters)

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def holding(self, lora_name: str, deadline: float) -> AsyncIterator[bool]:
        """Hold the version's lock if it can be taken before `deadline`; yields whether it was."""
        lock, users = self._locks.get(lora_name, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[lora_name] = (lock, users + 1)
        try:
            async with holding(lock, deadline) as held:
                yield held
        finally:
            _, users = self._locks[lora_name]
            if users > 1:
                self._locks[lora_name] = (lock, users - 1)
            else:
                del self._locks[lora_name]

    @contextlib.asynccontextmanager
    async def loading(self, lora_name: str, deadline: float) -> AsyncIterator[None]:
        """Hold a version's lock to load it as active or candidate; 502 when it is busy past `deadline`."""
        async with self.holding(lora_name, deadline) as held:
            if not held:
                raise LoraError("lora_activation_failed", f"an operation on {lora_name} is still running")
            yield
