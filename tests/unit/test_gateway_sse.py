"""SSE framing: any chunking of a real vLLM stream parses to the same events; CRLF, multi-line data, EOF, encoding."""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any, TypeVar

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openjiuwen.agent_evolving.agent_rl.gateway.proxy.sse import (
    DONE, EventTooLarge, SSEDecoder, SSEEvent, encode_sse, iter_sse_batches,
)
from tests.conftest import FIXTURES

T = TypeVar("T")

CHAT_SSE = (FIXTURES / "chat_stream_response.sse").read_bytes()
MESSAGES_SSE = (FIXTURES / "messages_stream_response.sse").read_bytes()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never really suspends (our sources are in-memory) without an event loop: fast enough
    for hundreds of hypothesis examples."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the coroutine suspended on real I/O")


async def _source(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def _collect(chunks: Iterable[bytes]) -> list[SSEEvent]:
    # The gateway's relay path: events batched per upstream read, flattened here.
    batches = iter_sse_batches(_source(chunks), max_event_bytes=1 << 20)
    return [event async for batch in batches for event in batch]


def parse(chunks: Iterable[bytes]) -> list[SSEEvent]:
    return run(_collect(chunks))


def split_at(raw: bytes, points: Iterable[int]) -> list[bytes]:
    cuts = [0, *sorted(set(points)), len(raw)]
    return [raw[a:b] for a, b in zip(cuts, cuts[1:])]


def expected_chat_events() -> list[SSEEvent]:
    blocks = [b for b in CHAT_SSE.decode().split("\n\n") if b]
    return [SSEEvent(None, block.removeprefix("data: ")) for block in blocks]


def test_recorded_chat_stream_parses_to_its_data_lines() -> None:
    events = parse([CHAT_SSE])
    assert events == expected_chat_events()
    assert len(events) == 9
    assert events[-1] == SSEEvent(None, DONE)
    chunks = [orjson.loads(e.data) for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == [1, 309, 201, 330, 329, 2, 201, 1, 295, 325, 201]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(CHAT_SSE) - 1), max_size=60))
def test_any_chunking_of_the_recorded_stream_gives_the_same_events(points: list[int]) -> None:
    # The fixture holds multi-byte UTF-8 (U+FFFD), so some cuts fall inside a character.
    assert parse(split_at(CHAT_SSE, points)) == expected_chat_events()


def test_one_byte_at_a_time() -> None:
    assert parse(CHAT_SSE[i : i + 1] for i in range(len(CHAT_SSE))) == expected_chat_events()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_crlf_stream_in_any_chunking(data: st.DataObject) -> None:
    raw = CHAT_SSE.replace(b"\n", b"\r\n")
    points = data.draw(st.lists(st.integers(min_value=1, max_value=len(raw) - 1), max_size=60))
    assert parse(split_at(raw, points)) == expected_chat_events()


def test_crlf_split_between_cr_and_lf_is_one_line_end() -> None:
    # If "\r" and "\n" were taken as two line ends, the blank line in between would dispatch early.
    assert parse([b"data: a\r", b"\ndata: b\r\n\r\n"]) == [SSEEvent(None, "a\nb")]


def test_lone_cr_line_endings() -> None:
    assert parse([b"event: e\rdata: x\r\rdata: y\r\r"]) == [SSEEvent("e", "x"), SSEEvent(None, "y")]


def test_multi_line_data_is_joined_with_newlines() -> None:
    raw = b"data: {\"a\":\ndata:  1}\ndata\n\n"
    # A field without a colon has an empty value; only ONE space after the colon is dropped.
    assert parse([raw]) == [SSEEvent(None, '{"a":\n 1}\n')]


def test_event_names_and_comments_of_the_recorded_anthropic_stream() -> None:
    events = parse([b": keep-alive\n\n", MESSAGES_SSE])
    assert [e.event for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]
    assert all(orjson.loads(e.data)["type"] == e.event for e in events)


def test_final_event_without_trailing_blank_line() -> None:
    assert parse([b"data: 1\n\ndata: [DO", b"NE]"]) == [SSEEvent(None, "1"), SSEEvent(None, DONE)]
    assert parse([b"event: x\ndata: y\r\n"]) == [SSEEvent("x", "y")]


def test_event_without_data_is_dropped_and_its_name_does_not_leak() -> None:
    raw = b"event: ping\n\ndata: a\n\nid: 7\nretry: 10\n: comment\n\n"
    assert parse([raw]) == [SSEEvent(None, "a")]


def test_empty_event_name_counts_as_none() -> None:
    assert parse([b"event:\ndata: a\n\n"]) == [SSEEvent(None, "a")]


def test_bom_and_invalid_utf8_are_tolerated() -> None:
    assert parse([b"\xef\xbb\xbfdata: a\n\n", b"data: \xff\n\n"]) == [SSEEvent(None, "a"), SSEEvent(None, "\ufffd")]


def test_empty_chunks_and_empty_stream() -> None:
    assert parse([]) == []
    assert parse([b"", b"data: a", b"", b"\n\n"]) == [SSEEvent(None, "a")]


def test_decoder_is_incremental() -> None:
    decoder = SSEDecoder(1 << 20)
    assert decoder.feed(b"data: a\n") == []
    assert decoder.feed(b"\ndata: b") == [SSEEvent(None, "a")]
    assert decoder.close() == [SSEEvent(None, "b")]
    assert decoder.close() == []


def test_encode_sse_wire_format() -> None:
    assert encode_sse(DONE) == b"data: [DONE]\n\n"
    assert encode_sse(b'{"a":1}', event="message_stop") == b'event: message_stop\ndata: {"a":1}\n\n'
    assert encode_sse("a\r\nb\nc") == b"data: a\ndata: b\ndata: c\n\n"
    with pytest.raises(ValueError, match="line break"):
        encode_sse("x", event="bad\nname")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.none() | st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]), min_size=1),
            st.text(st.characters(blacklist_characters="\r", blacklist_categories=["Cs"])),
        ),
        max_size=8,
    ),
    st.data(),
)
def test_encode_then_parse_round_trips(pairs: list[tuple[str | None, str]], data: st.DataObject) -> None:
    # A name starting with a space or a BOM would lose it in parsing (the spec strips one space); keep names plain.
    pairs = [(None if name is None else "e" + name, text) for name, text in pairs]
    raw = b"".join(encode_sse(text, event=name) for name, text in pairs)
    points = data.draw(st.lists(st.integers(min_value=1, max_value=max(1, len(raw) - 1)), max_size=20))
    assert parse(split_at(raw, points)) == [SSEEvent(name, text) for name, text in pairs]


async def test_batches_group_the_events_each_read_completes() -> None:
    chunks = [b"data: a\n\ndata: b\n\nda", b"ta: c", b"\n\n", b"", b"data: d"]
    decoded = iter_sse_batches(_source(chunks), max_event_bytes=1 << 20)
    batches = [[e.data for e in batch] async for batch in decoded]
    assert batches == [["a", "b"], ["c"], ["d"]]  # reads that complete nothing give no batch; the tail is flushed


@pytest.mark.parametrize("chunks", [
    [b"data: " + b"x" * 600, b"y" * 600],  # one line that never ends
    [b"data: " + b"x" * 400 + b"\n", b"data: " + b"y" * 400 + b"\n", b"data: z\n" * 400],  # never dispatched
])
def test_an_event_past_the_bound_is_refused_not_buffered(chunks: list[bytes]) -> None:
    decoder = SSEDecoder(1000)
    with pytest.raises(EventTooLarge, match="larger than 1000 bytes"):
        for chunk in chunks:
            decoder.feed(chunk)


def test_events_up_to_the_bound_pass_and_the_count_restarts_per_event() -> None:
    decoder = SSEDecoder(1000)
    for _ in range(50):  # 50 KB in all, each event under the bound
        assert decoder.feed(b"data: " + b"x" * 900 + b"\n\n") == [SSEEvent(None, "x" * 900)]
