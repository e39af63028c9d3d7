"""Server-Sent Events: incremental parsing from arbitrary byte chunks, and encoding (WHATWG event-stream framing)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

DONE = "[DONE]"  # the OpenAI end-of-stream sentinel, sent as `data: [DONE]`


class EventTooLarge(ValueError):
    """An event (its unterminated line, or its data lines so far) past the decoder's bound."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"stream event larger than {max_bytes} bytes")


@dataclass(frozen=True, slots=True)
class SSEEvent:
    event: str | None  # the `event:` field; None when absent or empty (the spec's default "message")
    data: str  # the `data:` lines joined by "\n"


class SSEDecoder:
    """Push bytes in any chunking, take complete events out; `close()` flushes a last event that had no blank line.

    Lines end with "\\n", "\\r\\n" or "\\r". Comments (":" lines), `id:` and `retry:` are ignored; a blank line
    dispatches the pending event if it has data. Invalid UTF-8 is replaced, never fatal. An event is held to
    `max_event_bytes`: a line never ended, or data lines never dispatched, raise EventTooLarge past it instead of
    growing the buffer without end.
    """

    __slots__ = ("_buf", "_event", "_data", "_data_bytes", "_first_line", "_max")

    def __init__(self, max_event_bytes: int) -> None:
        self._buf = bytearray()
        self._event: str | None = None
        self._data: list[str] = []
        self._data_bytes = 0
        self._first_line = True  # a byte-order mark is stripped from the first line only
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if not chunk:
            return []
        self._buf += chunk
        if b"\n" not in chunk and b"\r" not in chunk:
            if len(self._buf) + self._data_bytes > self._max:
                raise EventTooLarge(self._max)
            return []  # no line ended here; skipping the split keeps a long line arriving in pieces linear
        lines = self._buf.splitlines(keepends=True)  # bytes split only on \n, \r\n and \r
        if lines[-1].endswith(b"\n"):
            self._buf = bytearray()
        else:
            # Unterminated, or ending in a lone "\r" whose "\n" may open the next chunk: keep it for later.
            self._buf = lines.pop()
        events: list[SSEEvent] = []
        for raw in lines:
            event = self._line(bytes(raw.rstrip(b"\r\n")))
            if event is not None:
                events.append(event)
        if len(self._buf) + self._data_bytes > self._max:
            raise EventTooLarge(self._max)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: the unterminated last line counts, and a pending event is dispatched."""
        events: list[SSEEvent] = []
        if self._buf:
            line, self._buf = bytes(self._buf.rstrip(b"\r\n")), bytearray()
            event = self._line(line)
            if event is not None:
                events.append(event)
        event = self._dispatch()
        if event is not None:
            events.append(event)
        return events

    def _line(self, line: bytes) -> SSEEvent | None:
        if not line:
            self._first_line = False
            return self._dispatch()
        text = line.decode("utf-8", "replace")
        if self._first_line:
            self._first_line = False
            text = text.removeprefix("\ufeff")
        if text.startswith(":"):
            return None
        name, colon, value = text.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._data_bytes += len(line)
        elif name == "event":
            self._event = value or None
        return None

    def _dispatch(self) -> SSEEvent | None:
        event, self._event = self._event, None
        if not self._data:  # the spec drops an event without data (its name is reset all the same)
            return None
        data, self._data, self._data_bytes = "\n".join(self._data), [], 0
        return SSEEvent(event, data)


async def iter_sse_batches(chunks: AsyncIterator[bytes], *, max_event_bytes: int) -> AsyncIterator[list[SSEEvent]]:
    """The events completed by each chunk read, as one list (empty reads skipped); the final flush comes last. A
    relay that answers per batch writes once per upstream read instead of once per event. EventTooLarge past
    `max_event_bytes` for one event."""
    decoder = SSEDecoder(max_event_bytes)
    async for chunk in chunks:
        events = decoder.feed(chunk)
        if events:
            yield events
    events = decoder.close()
    if events:
        yield events


def encode_sse(data: str | bytes, event: str | None = None) -> bytes:
    """One event as wire bytes: `event: <name>` (if any), one `data:` line per line of `data`, a blank line."""
    payload = data.encode() if isinstance(data, str) else bytes(data)
    head = b""
    if event is not None:
        if "\n" in event or "\r" in event:
            raise ValueError("an SSE event name cannot contain a line break")
        head = b"event: " + event.encode() + b"\n"
    if b"\n" not in payload and b"\r" not in payload:  # the common case: one compact JSON document
        return head + b"data: " + payload + b"\n\n"
    lines = payload.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return head + b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
