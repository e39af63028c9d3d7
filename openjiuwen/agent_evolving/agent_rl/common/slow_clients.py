"""Slow-client limits for the uvicorn servers of the gateway and the RL Service (issue 19, item 8: slowloris).

uvicorn bounds the idle time between two requests of a connection (`timeout_keep_alive`), but not the time a client
takes to send a request head, nor the head's size, nor the number of open connections: a client that opens a
connection and sends a partial head (or nothing) holds it, and a file descriptor, forever. A thousand of them used
up the default 1024 open files and health checks and completions failed. Here:

- a **header deadline**: from the moment a connection opens (or the first byte of its next request arrives), the
  request head must be complete within `header_timeout_s`, else the client gets 408 and the connection closes;
  a head larger than MAX_HEAD_BYTES gets 431;
- a **connection cap** that sheds the slow, not the legitimate: past `max_connections`, the oldest connection that
  has not sent a complete head (or is idle between requests) is closed to make room. A newcomer is refused
  (503 `too_many_connections`) only when every connection is busy with a real request. uvicorn's own
  `limit_concurrency` is not used: it answers 503 to whoever *completes* a head once the count is reached, which
  under a flood of slow heads is exactly every legitimate client (health checks included);
- `raise_open_files_limit`: the soft RLIMIT_NOFILE raised to the hard limit at start (the systemd default soft
  limit is 1024), and the cap clamped to what the descriptors left allow.

Both servers use the httptools protocol (a declared dependency; uvicorn's "auto" picks it too), subclassed here and
passed as `http=` to uvicorn.Config. Counts of closed connections are logged at most once a minute, never per event.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("openjiuwen.agent_rl.http")

MAX_HEAD_BYTES = 64 * 1024  # request line and headers; agents' heads are well under 8 KiB
FD_RESERVE = 256  # descriptors kept for listeners, log files, Redis, the RL Service, subprocess pipes
FDS_PER_CONNECTION = 2  # a proxied request holds its client's connection and one to an upstream
TALLY_INTERVAL_S = 60.0


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 4096


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it); return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft


def effective_max_connections(configured: int, open_files: int) -> int:
    """The cap the descriptors allow: a configured cap above it would end in EMFILE, which refuses everyone."""
    allowed = max(16, (open_files - FD_RESERVE) // FDS_PER_CONNECTION)
    if configured > allowed:
        log.warning(
            "max connections %d exceeds what the open-files limit %d allows; using %d (raise LimitNOFILE)",
            configured, open_files, allowed,
        )
        return allowed
    return configured


def _raw_error(status: int, reason: str, code: str, message: str) -> bytes:
    body = orjson.dumps({"error": {"code": code, "message": message}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "x-content-type-options: nosniff\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


REQUEST_TIMEOUT = _raw_error(408, "Request Timeout", "request_timeout", "the request head was not complete in time")
HEAD_TOO_LARGE = _raw_error(431, "Request Header Fields Too Large", "request_header_too_large",
                            f"the request head is larger than {MAX_HEAD_BYTES} bytes")
TOO_MANY = _raw_error(503, "Service Unavailable", "too_many_connections",
                      "every connection is busy with a request; retry later")


class _Tally:
    """Connections closed per reason, logged as one line at most every TALLY_INTERVAL_S."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts: dict[str, int] = {}
        self.logged_at = 0.0

    def add(self, reason: str, now: float) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if now - self.logged_at >= TALLY_INTERVAL_S:
            summary = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
            log.warning("%s: closed slow or surplus connections: %s", self.name, summary)
            self.counts.clear()
            self.logged_at = now


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a head-size bound and a shedding connection cap.

    Use `guarded_protocol(limits)`: it makes a subclass holding the limits and the server's connection registry.
    """

    limits: ConnectionLimits = ConnectionLimits()
    registry: "OrderedDict[GuardedHttpToolsProtocol, None]" = OrderedDict()  # replaced per server
    tally: _Tally = _Tally("http")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._awaiting_head = True
        self._head_bytes = 0

    # --- connection --------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()
        registry = type(self).registry
        registry[self] = None
        if len(registry) > self.limits.max_connections and not self._shed_one():
            self._close_with(TOO_MANY, "refused_busy")

    def connection_lost(self, exc: Exception | None) -> None:
        type(self).registry.pop(self, None)
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head:  # a chunk that also ends a head overcounts by its body part: judged after parsing
            self._head_bytes += len(data)
        super().data_received(data)
        # Still no complete head after this chunk (a head and its body in one chunk do not count).
        if self._awaiting_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._close_with(HEAD_TOO_LARGE, "head_too_large")

    # --- parser callbacks (httptools calls them on this object) ------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_head = True  # its bytes were counted from the chunk it began in (reset at the last head's end)
        if self._head_timer is None:  # a next request on a kept-alive connection: its own deadline
            self._arm_head_deadline()

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._head_bytes = 0
        self._cancel_head_deadline()
        super().on_headers_complete()

    # --- limits ------------------------------------------------------------------------------------------------

    def _arm_head_deadline(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_deadline_passed)

    def _cancel_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _serving(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _head_deadline_passed(self) -> None:
        self._head_timer = None
        if not self._awaiting_head or self.transport.is_closing():
            return
        if self._serving():  # a pipelined head behind a running request: never cut that request's answer
            self._arm_head_deadline()
            return
        self._close_with(REQUEST_TIMEOUT, "header_timeout")

    @property
    def _sheddable(self) -> bool:
        """No request of this connection is being served: it waits for a head, or idles between requests."""
        return not self._serving() and (self._awaiting_head or self.timeout_keep_alive_task is not None)

    def _shed_one(self) -> bool:
        """Close the oldest sheddable connection other than the newest; False when all are busy."""
        registry = type(self).registry
        for _ in range(len(registry) - 1):
            oldest = next(iter(registry))
            if oldest is self:
                break
            if oldest._sheddable:
                registry.pop(oldest)
                oldest._cancel_head_deadline()
                oldest.transport.close()
                self.tally.add("shed", self.loop.time())
                return True
            registry.move_to_end(oldest)  # busy: looked at again only after every other one (amortized O(1))
        return False

    def _close_with(self, answer: bytes, reason: str) -> None:
        type(self).registry.pop(self, None)  # closing: no longer a slot another newcomer could be given
        self._cancel_head_deadline()
        self.transport.write(answer)
        self.transport.close()
        self.tally.add(reason, self.loop.time())


def guarded_protocol(limits: ConnectionLimits, *, name: str) -> type[GuardedHttpToolsProtocol]:
    """A protocol class for one server: its limits, its own connection registry and log tally."""
    attrs = {"limits": limits, "registry": OrderedDict(), "tally": _Tally(name)}
    return type(f"GuardedHttpToolsProtocol_{name}", (GuardedHttpToolsProtocol,), attrs)


def server_config(app: Any, *, host: str, port: int, limits: ConnectionLimits, name: str, **kwargs: Any) -> Any:
    """uvicorn.Config with these limits; raises the open-files limit first and clamps the cap to it."""
    import uvicorn

    open_files = raise_open_files_limit()
    clamped = ConnectionLimits(
        header_timeout_s=limits.header_timeout_s, keep_alive_s=limits.keep_alive_s,
        max_connections=effective_max_connections(limits.max_connections, open_files),
    )
    return uvicorn.Config(
        app, host=host, port=port, http=guarded_protocol(clamped, name=name), ws="none",
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float works: it feeds call_later
        **kwargs,
    )
