"""Polling a condition in tests that drive real processes (there is no event to wait on across processes)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition") -> T:
    """The first truthy value of `predicate()`, polled every 50 ms; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


async def wait_for_async(
    predicate: Callable[[], Awaitable[T] | T], timeout_s: float = 10.0, what: str = "condition",
) -> T:
    """`wait_for` inside an event loop (the code under test runs in the same loop); `predicate` may be a coroutine
    function or a plain one."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)
