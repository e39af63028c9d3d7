"""A uvicorn server that stays asleep while idle.

uvicorn's main loop wakes every 100 ms to refresh its `Date` header and to look for a stop request: ten wake-ups a
second in every process, which on an idle service was most of its CPU (about 3 ms a second here) and, at one agent
session, most of what a captured call seemed to cost. This server wakes once a second (the `Date` header keeps its
one-second resolution) and at once when asked to stop, from a signal or from another thread.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

import uvicorn

TICK_S = 1.0
_DATE_EVERY = 10  # uvicorn refreshes the Date header on ticks that are multiples of 10


class QuietServer(uvicorn.Server):
    _stop_asked = False
    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    @property  # type: ignore[override]
    def should_exit(self) -> bool:
        return self._stop_asked

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._stop_asked = value
        loop, wake = self._loop, self._wake
        if value and loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + _DATE_EVERY) % 864000
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            should_exit = await self.on_tick(counter)
