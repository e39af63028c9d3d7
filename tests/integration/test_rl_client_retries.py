"""The gateway's proxied calls to its RL Service survive a worker that dies with the request (CONTRACT §2.11):
idempotent calls are sent again when the connection broke before an answer; others are not, and timeouts never.

The RL Service is a raw loopback server that resets the first `resets` connections after reading a request head.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from openjiuwen.agent_evolving.agent_rl.common.wire.routes import idempotent
from openjiuwen.agent_evolving.agent_rl.gateway.rl.rl_client import RLClient


class Flaky:
    def __init__(self, resets: int, *, hang_s: float = 0.0) -> None:
        self.resets, self.hang_s = resets, hang_s
        self.heads: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head.split(b"\r\n", 1)[0])
        if len(self.heads) <= self.resets:
            if self.hang_s:
                await asyncio.sleep(self.hang_s)
            writer.transport.abort()  # a reset: the worker died with the request
            return
        body = b'{"status": "finalized"}'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def client(url: str, retries: int = 2, timeout_s: float = 5.0) -> RLClient:
    return RLClient(endpoint=url, token=lambda: "tok", hook_timeout_s=5.0, hook_retries=retries,
                    control_timeout_s=timeout_s)


def test_which_calls_are_sent_again() -> None:
    assert idempotent("GET", "/v1/rl/tasks/t1") and idempotent("POST", "/v1/rl/tasks/start")
    assert idempotent("POST", "/v1/rl/tasks/t1/stop") and idempotent("POST", "/v1/rl/tasks/t1/reward")
    assert not idempotent("POST", "/v1/rl/rollout/promote")
    assert not idempotent("POST", "/v1/rl/training/runs")
    assert not idempotent("POST", "/v1/rl/rail/upload")
    assert not idempotent("POST", "/v1/rl/tasks/t1/stop/x")


async def test_an_idempotent_call_is_sent_again_after_a_reset() -> None:
    flaky = Flaky(resets=2)
    async with flaky as url:
        rl = client(url)
        answer = await rl.forward("POST", "/v1/rl/tasks/t1/stop", body=b"{}")
        await rl.aclose()
    assert (answer.status, answer.json()) == (200, {"status": "finalized"})
    assert flaky.heads == [b"POST /v1/rl/tasks/t1/stop HTTP/1.1"] * 3


async def test_retries_are_bounded() -> None:
    flaky = Flaky(resets=5)
    async with flaky as url:
        rl = client(url, retries=1)
        with pytest.raises(httpx.TransportError):
            await rl.forward("GET", "/v1/rl/tasks/t1")
        await rl.aclose()
    assert len(flaky.heads) == 2


async def test_a_call_that_is_not_idempotent_is_sent_once() -> None:
    flaky = Flaky(resets=1)
    async with flaky as url:
        rl = client(url)
        with pytest.raises(httpx.TransportError):
            await rl.forward("POST", "/v1/rl/rollout/promote", body=b"{}")
        await rl.aclose()
    assert len(flaky.heads) == 1


async def test_a_timeout_is_not_sent_again() -> None:
    flaky = Flaky(resets=1, hang_s=2.0)
    async with flaky as url:
        rl = client(url, timeout_s=0.3)
        with pytest.raises(httpx.TimeoutException):
            await rl.forward("POST", "/v1/rl/tasks/t1/stop", body=b"{}")
        await rl.aclose()
    assert len(flaky.heads) == 1
