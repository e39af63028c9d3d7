"""A lean keep-alive HTTP/1.1 client for the gateway's two hot paths: the capture hooks to the RL Service and the
inference calls to vLLM (CONTRACT §3.5).

Why not httpx here: under a few dozen concurrent sessions its pool walks every pooled connection on each request
(and polls each socket), which profiled as the largest cost of a captured completion. This client keeps, per origin,
a LIFO list of idle connections (O(1) to take one), parses answers with httptools (already a uvicorn dependency),
and hands bodies over as bytes. Only what the gateway needs: http/https, a body given as bytes, whole answers or
streamed bodies, per-call timeouts. Control-plane calls stay on httpx.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

_READ_SIZE = 1 << 18


class HttpError(Exception):
    """Base of every failure of this client."""


class TransportError(HttpError):
    """No (complete) HTTP answer: connect failure, reset, closed early, malformed answer."""


class HttpTimeout(TransportError):
    """A timeout (connect, whole request, or one read of a streamed body)."""


class AnswerTooLarge(HttpError):
    """A body past the reader's bound (declared in Content-Length, or counted while read): reading stopped there."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"answer larger than {max_bytes} bytes")
        self.max_bytes = max_bytes


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes


class _Parser:
    """httptools callbacks: collects status, headers and body pieces of one answer."""

    __slots__ = ("headers", "pieces", "headers_done", "complete", "keep_alive", "received", "parser")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.pieces: list[bytes] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of the answer arrived
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        # Read here: once the message is complete the parser resets and always answers False.
        self.keep_alive = self.parser.should_keep_alive()

    def take(self) -> bytes:
        data = b"".join(self.pieces)
        self.pieces.clear()
        return data


class _Connection:
    __slots__ = ("reader", "writer", "idle_since", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0
        self.reused = False

    def usable(self, now: float, expiry_s: float) -> bool:
        # The server may have closed an idle connection: its FIN shows up as EOF without any syscall here.
        return (not self.writer.is_closing() and not self.reader.at_eof()
                and now - self.idle_since < expiry_s)

    def close(self) -> None:
        self.writer.close()


@dataclass(frozen=True, slots=True)
class _Origin:
    scheme: str
    host: str
    port: int
    host_header: str


class StreamedAnswer:
    """An answer whose headers have arrived; read the body with `aread()` or `aiter_raw()`, then `aclose()`."""

    def __init__(self, client: "Http11Client", origin: _Origin, conn: _Connection, parser: _Parser,
                 read_timeout_s: float) -> None:
        self._client, self._origin, self._conn, self._p = client, origin, conn, parser
        self._read_timeout_s = read_timeout_s
        self.status = parser.parser.get_status_code()
        self.headers = parser.headers
        self._closed = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        first = self._p.take()  # body bytes that came with the headers
        if first:
            yield first
        while not self._p.complete:
            await self._client._read_into(self._conn, self._p, self._read_timeout_s)
            data = self._p.take()
            if data:
                yield data

    async def aread(self, *, max_bytes: int | None = None) -> bytes:
        """The whole body. Past `max_bytes` (declared in Content-Length, or counted while read) AnswerTooLarge, with
        at most one read beyond the bound held; the caller's `aclose()` then drops the connection unread."""
        if max_bytes is None:
            return b"".join([piece async for piece in self.aiter_raw()])
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise AnswerTooLarge(max_bytes)
        return b"".join([piece async for piece in self.aiter_bounded(max_bytes)])

    async def aiter_bounded(self, max_bytes: int) -> AsyncIterator[bytes]:
        """`aiter_raw()` that raises AnswerTooLarge once more than `max_bytes` arrived in all."""
        size = 0
        async for piece in self.aiter_raw():
            size += len(piece)
            if size > max_bytes:
                raise AnswerTooLarge(max_bytes)
            yield piece

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._p.complete and self._p.keep_alive:
            self._client._release(self._origin, self._conn)
        else:
            self._conn.close()  # an unread or broken body: the connection cannot carry another request


class Http11Client:
    def __init__(self, *, keepalive_expiry_s: float = 2.0, connect_timeout_s: float = 10.0,
                 max_idle_per_origin: int = 512) -> None:
        self._expiry_s = keepalive_expiry_s
        self._connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle_per_origin
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._origins: dict[str, tuple[_Origin, str]] = {}
        self._ssl: ssl.SSLContext | None = None

    # ------------------------------------------------------------------ public

    async def request(self, method: str, url: str, *, content: bytes = b"", headers: dict[str, str] | None = None,
                      timeout_s: float) -> Answer:
        """The whole exchange bounded by `timeout_s`; raises HttpTimeout / TransportError."""
        try:
            async with asyncio.timeout(timeout_s):
                answer = await self.open_stream(method, url, content=content, headers=headers,
                                                read_timeout_s=timeout_s)
                try:
                    body = await answer.aread()
                finally:
                    await answer.aclose()
        except TimeoutError as exc:
            raise HttpTimeout(f"{method} {url}: timed out after {timeout_s} s") from exc
        return Answer(answer.status, answer.headers, body)

    async def open_stream(self, method: str, url: str, *, content: bytes = b"",
                          headers: dict[str, str] | None = None, read_timeout_s: float) -> StreamedAnswer:
        """Send the request and wait for the answer's headers (each read bounded by `read_timeout_s`)."""
        origin, target = self._origin(url)
        raw = self._encode(method, target, origin, content, headers)
        while True:
            conn = await self._acquire(origin)
            parser = _Parser()
            try:
                conn.writer.write(raw)
                while not parser.headers_done:
                    await self._read_into(conn, parser, read_timeout_s)
            except TransportError as exc:
                conn.close()
                # A reused connection the server closed while idle (it never read this request): once more on a
                # fresh one. A fresh connection failing is a real failure.
                if conn.reused and isinstance(exc, _ClosedBeforeAnswer):
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            return StreamedAnswer(self, origin, conn, parser, read_timeout_s)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    # ---------------------------------------------------------------- internals

    def _origin(self, url: str) -> tuple[_Origin, str]:
        base, sep, rest = url.partition("://")
        host_part, slash, path = rest.partition("/")
        key = base + sep + host_part
        cached = self._origins.get(key)
        if cached is None:
            parts = urlsplit(key)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"unsupported URL {url!r}")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            cached = (_Origin(parts.scheme, parts.hostname, port, parts.netloc), key)
            self._origins[key] = cached
        return cached[0], "/" + path if slash else "/"

    @staticmethod
    def _encode(method: str, target: str, origin: _Origin, content: bytes, headers: dict[str, str] | None) -> bytes:
        head = [f"{method} {target} HTTP/1.1\r\nhost: {origin.host_header}\r\ncontent-length: {len(content)}\r\n"]
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}\r\n")
        head.append("\r\n")
        return "".join(head).encode("latin-1") + content

    async def _acquire(self, origin: _Origin) -> _Connection:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now, self._expiry_s):
                conn.reused = True
                return conn
            conn.close()
        if origin.scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    origin.host, origin.port, limit=_READ_SIZE, ssl=self._ssl if origin.scheme == "https" else None)
        except TimeoutError as exc:
            raise HttpTimeout(f"connect to {origin.host}:{origin.port} timed out") from exc
        except OSError as exc:
            raise TransportError(f"connect to {origin.host}:{origin.port} failed: {exc}") from exc
        return _Connection(reader, writer)

    def _release(self, origin: _Origin, conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= self._max_idle or conn.writer.is_closing():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    @staticmethod
    async def _read_into(conn: _Connection, parser: _Parser, read_timeout_s: float) -> None:
        try:
            async with asyncio.timeout(read_timeout_s):
                data = await conn.reader.read(_READ_SIZE)
        except TimeoutError as exc:
            raise HttpTimeout(f"read timed out after {read_timeout_s} s") from exc
        except OSError as exc:
            if not parser.received:
                raise _ClosedBeforeAnswer(f"connection lost before the answer: {exc}") from exc
            raise TransportError(f"connection lost: {exc}") from exc
        if not data:
            # Every server we call frames its bodies (content-length or chunked), so EOF is never a valid end.
            if not parser.received:
                raise _ClosedBeforeAnswer("connection closed before the answer")
            raise TransportError("connection closed before the end of the answer")
        parser.received = True
        try:
            parser.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            raise TransportError("unexpected protocol upgrade") from exc
        except httptools.HttpParserError as exc:
            raise TransportError(f"malformed HTTP answer: {exc}") from exc


class _ClosedBeforeAnswer(TransportError):
    """The peer closed the connection before sending a single byte of the answer."""
