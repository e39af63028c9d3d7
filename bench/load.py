"""A lean closed-loop HTTP/1.1 load generator for the benches: one keep-alive connection per session, one request at a
time on it, latency = request written → last byte of the answer read (JSON or a whole SSE stream).

Kept lean (raw asyncio streams + httptools, no HTTP client library) because the driver shares the same two cores as
the processes it measures: an expensive client would show up as latency of the system under test.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httptools


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


@dataclass
class _Answer:
    status: int = 0
    body: list[bytes] = field(default_factory=list)
    done: bool = False


class _Parser:
    def __init__(self) -> None:
        self.answer = _Answer()
        self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self.answer.body.append(body)

    def on_message_complete(self) -> None:
        self.answer.done = True
        self.keep_alive = self.parser.should_keep_alive()  # the parser resets once the message is complete


class _ClosedIdle(Exception):
    """The connection ended before any byte of the answer."""


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        reused = self.writer is not None
        try:
            return await self._exchange(raw)
        except _ClosedIdle:
            if not reused:
                raise ConnectionError("server closed the connection") from None
            # The server closed this kept-alive connection while it sat idle (its keep-alive timeout: a session that
            # waited for the others' warm-up); it never read this request. Once more on a fresh connection.
            await self.close()
            try:
                return await self._exchange(raw)
            except _ClosedIdle:
                raise ConnectionError("server closed the connection") from None

    async def _exchange(self, raw: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        assert self.reader is not None
        p = _Parser()
        self.writer.write(raw)
        received = False
        while not p.answer.done:
            try:
                data = await self.reader.read(1 << 20)
            except ConnectionResetError:
                data = b""
            if not data:
                if not received:
                    raise _ClosedIdle
                raise ConnectionError("server closed the connection")
            received = True
            p.parser.feed_data(data)
        status = p.parser.get_status_code()
        if not p.keep_alive:
            await self.close()
        return status, b"".join(p.answer.body)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


def post(path: str, body: bytes, headers: dict[str, str] | None = None, host: str = "127.0.0.1") -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: {host}", "content-type: application/json",
             f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def closed_loop(
    port: int, requests: Callable[[int], bytes], *, concurrency: int, calls: int, warmup: int = 1,
    check: Callable[[int, bytes], None] | None = None,
) -> dict[str, float]:
    """`concurrency` sessions, each on its own connection sending `requests(session)` until `calls` are done (after
    `warmup` calls per session that are not measured). Returns p50/p99/mean ms and throughput (calls/s)."""
    conns = [Connection("127.0.0.1", port) for _ in range(concurrency)]
    latencies: list[float] = []
    remaining = calls

    async def session(i: int) -> None:
        nonlocal remaining
        raw = requests(i)
        for _ in range(warmup):
            status, body = await conns[i].request(raw)
            if check:
                check(status, body)
        ready.append(i)
        await start.wait()
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            status, body = await conns[i].request(raw)
            latencies.append((time.perf_counter() - t0) * 1000)
            if check:
                check(status, body)

    start = asyncio.Event()
    ready: list[int] = []
    tasks = [asyncio.create_task(session(i)) for i in range(concurrency)]
    try:
        # Warm-up first on every connection, then all sessions start together.
        while len(ready) < concurrency and not any(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        for t in tasks:
            if t.done() and t.exception():
                raise t.exception()  # type: ignore[misc]
        t_start = time.perf_counter()
        start.set()
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:  # one session failed: the others stop, and their errors are collected, not left unretrieved
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            await c.close()
    wall = time.perf_counter() - t_start
    return {"p50_ms": statistics.median(latencies), "p99_ms": percentile(latencies, 99),
            "mean_ms": statistics.fmean(latencies), "throughput_rps": len(latencies) / wall, "calls": len(latencies)}
