"""The capture bench measures the peers beside ours; a peer that resets connections or answers errors under load
(seen once: a peer reset a connection at 64 sessions and `make bench-quick` died with it) is reported in its row,
and the peers that answer are still measured. Real loopback servers, one of each kind."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from types import SimpleNamespace

import pytest

from bench.capture_bench import measure_peers

pytestmark = pytest.mark.system

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def _answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Keep-alive: every request (head, then `content-length` bytes of body) gets a 200."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(OK)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _resetting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(1)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
    writer.transport.abort()


def _peer(name: str, server: asyncio.Server) -> SimpleNamespace:
    return SimpleNamespace(name=name, port=server.sockets[0].getsockname()[1], proc=SimpleNamespace(pid=os.getpid()),
                           session_request=lambda i: ("/v1/chat/completions", {}))


async def test_a_peer_that_resets_is_reported_and_the_others_measured():
    good = await asyncio.start_server(_answering, "127.0.0.1", 0)
    bad = await asyncio.start_server(_resetting, "127.0.0.1", 0)
    async with good, bad:
        measured, errors = await measure_peers({}, [_peer("resets", bad), _peer("answers", good)], b"{}",
                                               concurrency=2, calls=6)
    assert list(measured) == ["peer:answers"] and measured["peer:answers"]["calls"] == 6
    assert list(errors) == ["resets"] and errors["resets"].startswith(("ConnectionResetError", "ConnectionError"))


async def test_a_kept_alive_connection_closed_while_idle_is_opened_again():
    """A server closes each connection after one answer, as one whose keep-alive timeout passed while a session
    waited for the others' warm-up (the full bench's 256 large-SSE sessions died of it): the request never read
    is sent again on a fresh connection. A fresh connection that ends before answering is still an error."""
    from bench.load import Connection, closed_loop, post

    async def one_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # without `connection: close`: the client believes the connection kept alive

    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    closing = await asyncio.start_server(one_answer, "127.0.0.1", 0)
    silent = await asyncio.start_server(never_answers, "127.0.0.1", 0)
    async with closing, silent:
        port = closing.sockets[0].getsockname()[1]

        result = await closed_loop(port, lambda i: post("/x", b"{}"), concurrency=2, calls=6)
        assert result["calls"] == 6
        with pytest.raises(ConnectionError):
            await Connection("127.0.0.1", silent.sockets[0].getsockname()[1]).request(post("/x", b"{}"))
