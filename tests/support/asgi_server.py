"""Serve an ASGI app from uvicorn in a background thread on a free 127.0.0.1 port (a real socket)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import uvicorn

_START_TIMEOUT_S = 10.0


class ThreadedServer:
    def __init__(self, app: Any, *, name: str = "asgi", port: int = 0) -> None:
        """`port`: 0 for a free one; a given port brings a stopped server back at its old address."""
        self._app = app
        self._name = name
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ThreadedServer":
        # Binding here gives the port before the thread starts and leaves no free-port race.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", self.port))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"{self._name}:{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started:  # uvicorn has no start event; bounded, startup only
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self._name} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None

    async def astart(self) -> "ThreadedServer":
        return await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)
