"""The uvicorn server both processes run (common/quiet_server.py): asleep while idle, prompt to stop, same answers."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from openjiuwen.agent_evolving.agent_rl.common.quiet_server import QuietServer


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


class CountingServer(QuietServer):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


def serve() -> tuple[CountingServer, threading.Thread, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = CountingServer(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return server, thread, sock.getsockname()[1]


def test_an_idle_server_wakes_once_a_second_and_stops_at_once_when_asked() -> None:
    server, thread, port = serve()
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/")
        assert (answer.status_code, answer.text) == (200, "ok")
        assert answer.headers["date"]  # the Date header is still kept
        ticks = server.ticks
        time.sleep(2.2)
        assert server.ticks - ticks <= 3  # uvicorn's own loop: 22 wake-ups in 2.2 s
    finally:
        asked = time.monotonic()
        server.should_exit = True  # from another thread, as a test harness or a signal handler does
        thread.join(10)
    assert not thread.is_alive()
    assert time.monotonic() - asked < 0.5  # not a whole tick
