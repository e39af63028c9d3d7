"""The RL Service serves loopback only (CONTRACT §1, §8 `listen_host`, D20).

`main()` refuses a non-loopback `listen_host` (tests/system/test_service_process.py, tests/unit/test_config.py).
The uvicorn factory binds whatever its command line says, so the guard middleware also refuses every request that
arrived on a non-loopback local address: checked here on raw ASGI scopes, and with the factory really bound to
0.0.0.0 and reached through this machine's own non-loopback address.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from openjiuwen.agent_evolving.agent_rl.common.request_guards import GuardMiddleware
from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.support.redis_server import free_port

pytestmark = pytest.mark.system


async def _status(server: tuple[str, int] | None) -> tuple[int, bytes]:
    async def app(scope, receive, send):  # noqa: ANN001 - a bare ASGI app
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/health", "headers": [], "server": server}
    await GuardMiddleware(app, token=None, max_body_bytes=1024)(scope, receive, send)
    return sent[0]["status"], sent[1]["body"]


@pytest.mark.parametrize("server", [("192.0.2.1", 18081), ("10.0.0.7", 80), ("::ffff:192.0.2.1", 1), ("fd00::2", 1),
                                    ("0.0.0.0", 1)])
async def test_requests_on_a_non_loopback_address_are_403(server: tuple[str, int]) -> None:
    status, body = await _status(server)
    assert (status, body) == (403, b'{"error":{"code":"forbidden","message":"the RL Service serves loopback clients only"}}')


@pytest.mark.parametrize("server", [("127.0.0.1", 18081), ("127.8.9.1", 1), ("::1", 1), ("::ffff:127.0.0.1", 1),
                                    ("rl.test", 80), None])
async def test_loopback_unix_socket_and_in_process_requests_pass(server: tuple[str, int] | None) -> None:
    assert await _status(server) == (200, b"ok")


def _own_non_loopback_ipv4() -> str | None:
    """This machine's outward IPv4 address (a UDP connect sends nothing), or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith(("127.", "0.")) else address


async def test_uvicorn_factory_bound_to_all_interfaces_still_serves_loopback_only(redis, redis_url, tmp_path: Path):
    outward = _own_non_loopback_ipv4()
    if outward is None:
        pytest.skip("this machine has no non-loopback IPv4 address to reach the service through")
    port = free_port()
    config = tmp_path / "rl.yaml"
    config.write_text(yaml.safe_dump({
        "redis_url": redis_url, "model_id": "tiny", "base_model_path": "/models/tiny",
        "lora_repository_path": str(tmp_path / "loras"), "log_path": str(tmp_path / "rl.log"),
    }))
    env = {k: v for k, v in os.environ.items() if k != "RL_SERVICE_TOKEN"}
    env["RL_SERVICE_CONFIG"] = str(config)
    err = (tmp_path / "uvicorn.stderr").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "openjiuwen.agent_evolving.agent_rl.online.service:create_app",
         "--host", "0.0.0.0", "--port", str(port)], env=env, stdout=err, stderr=err, start_new_session=True)
    err.close()
    try:
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            deadline = time.monotonic() + 20
            while True:
                assert proc.poll() is None, (tmp_path / "uvicorn.stderr").read_text()
                try:
                    if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the factory did not become ready"
                await asyncio.sleep(0.05)
            for method, path in (("GET", "/health"), ("GET", "/v1/rl/trajectories/stats"),
                                 ("POST", "/v1/rl/tasks/start")):
                r = await client.request(method, f"http://{outward}:{port}{path}", json={"reward_mode": "terminal"})
                assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden"), (path, r.text)
            assert (await client.get(f"http://127.0.0.1:{port}/v1/rl/trajectories/stats")).status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_gateway_listening_on_all_interfaces_serves_the_network(redis, redis_url, tmp_path: Path) -> None:
    """The body-limit guard the gateway shares with the service must not make the gateway loopback-only."""
    outward = _own_non_loopback_ipv4()
    if outward is None:
        pytest.skip("this machine has no non-loopback IPv4 address to reach the gateway through")
    with FakeVLLM(served_model="tiny") as vllm, GatewayProcess(
        tmp_path, redis_url, instances=[vllm], listen_host="0.0.0.0",
    ) as gw:
        gw.start_service()
        with httpx.Client(base_url=f"http://{outward}:{gw.port}", timeout=10, trust_env=False) as client:
            assert client.get("/aigw/v1/health").json()["status"] == "ok"
            r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            assert client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"}).status_code == 401
