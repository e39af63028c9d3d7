"""RL Service supervision by the gateway (CONTRACT §3.3 supervision and service start/stop/status, §2.1 process).

The child is the real RL Service (`python -m …online.service`, scripted trainer) on the session's private Redis, or,
where the test is about the supervisor alone, a tiny stand-in that answers `/health` and has no watchdog of its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from openjiuwen.agent_evolving.agent_rl.gateway.rl.supervisor import RLSupervisor, SupervisorError
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.support.redis_server import free_port
from tests.support.service_app import start_headers
from tests.support.service_process import REPO_ROOT, process_gone

SERVICE = [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.online.service"]

# A stand-in child: serves GET /health = 200 on the port written in its "config" file; optionally ignores SIGTERM.
STAND_IN = (
    "import http.server, signal, sys\n"
    "port = int(open(sys.argv[sys.argv.index('--config') + 1]).read())\n"
    "if 'ignore-term' in sys.argv:\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200 if self.path == '/health' else 404)\n"
    "        self.send_header('Content-Length', '0')\n"
    "        self.end_headers()\n"
    "    def log_message(self, *args):\n"
    "        pass\n"
    "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n"
)

# The gateway stand-in for the parent-death test: starts a supervised child, prints its pid, then waits forever.
GATEWAY = (
    "import asyncio, json, sys\n"
    "from openjiuwen.agent_evolving.agent_rl.gateway.rl.supervisor import RLSupervisor\n"
    "async def main():\n"
    "    sup = RLSupervisor(command=json.loads(sys.argv[1]), config_path=sys.argv[2], endpoint=sys.argv[3],\n"
    "                       control_timeout_s=30)\n"
    "    await sup.start()\n"
    "    print(sup.pid, flush=True)\n"
    "    await asyncio.sleep(3600)\n"
    "asyncio.run(main())\n"
)


def service_config(tmp_path: Path, redis_url: str, **overrides: Any) -> tuple[str, str]:
    """A real RL Service config on a free port: (config path, endpoint)."""
    port = free_port()
    data = {
        "listen_host": "127.0.0.1",
        "listen_port": port,
        "redis_url": redis_url,
        "model_id": "tiny",
        "base_model_path": "/models/tiny",
        "lora_repository_path": str(tmp_path / "loras"),
        "log_path": str(tmp_path / "rl-service.log"),
        "trainer_backend": "scripted",
        **overrides,
    }
    path = tmp_path / f"rl-service-{port}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path), f"http://127.0.0.1:{port}"


def stand_in_config(tmp_path: Path) -> tuple[str, str]:
    port = free_port()
    path = tmp_path / f"stand-in-{port}.txt"
    path.write_text(str(port))
    return str(path), f"http://127.0.0.1:{port}"


@pytest.fixture
async def supervisors(tmp_path: Path) -> AsyncIterator[Callable[..., RLSupervisor]]:
    made: list[RLSupervisor] = []

    def make(**kwargs: Any) -> RLSupervisor:
        kwargs.setdefault("control_timeout_s", 30.0)
        kwargs.setdefault("log_dir", tmp_path / "logs")
        sup = RLSupervisor(**kwargs)
        made.append(sup)
        return sup

    yield make
    for sup in made:
        await sup.close()


async def wait_gone(pid: int, timeout_s: float) -> float:
    """Seconds until `pid` is gone; fails after `timeout_s`. Polls: another process's death has no event to await."""
    began = time.monotonic()
    while not process_gone(pid):
        assert time.monotonic() - began < timeout_s, f"pid {pid} still alive after {timeout_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - began


async def task_record(redis, t: str) -> dict:
    raw = await redis.get(keys.task(t))
    assert raw is not None, f"no record for task {t}"
    return orjson.loads(raw)


async def start_task(endpoint: str, token: str, session: str, t: str) -> None:
    async with httpx.AsyncClient(base_url=endpoint, timeout=10, trust_env=False) as client:
        resp = await client.post(
            "/v1/rl/tasks/start", json={"reward_mode": "terminal"},
            headers={**start_headers(session, t), "Authorization": f"Bearer {token}"},
        )
    assert resp.status_code == 201, resp.text


async def test_start_stop_with_the_real_service(supervisors, redis, redis_url, tmp_path: Path):
    config_path, endpoint = service_config(tmp_path, redis_url)
    sup = supervisors(command=SERVICE, config_path=config_path, endpoint=endpoint)
    assert sup.status() == {"status": "stopped", "failure_reason": None} and sup.token is None

    assert await sup.start() == {"status": "running", "failure_reason": None}
    pid, token = sup.pid, sup.token
    assert pid is not None and token
    async with httpx.AsyncClient(base_url=endpoint, timeout=10, trust_env=False) as client:
        assert (await client.get("/health")).status_code == 200
        denied = await client.get("/v1/rl/tasks/t1")
        assert (denied.status_code, denied.json()["error"]["code"]) == (401, "unauthorized")
        other = await client.get("/v1/rl/tasks/t1", headers={"Authorization": "Bearer not-the-token"})
        assert other.status_code == 401
        unknown = await client.get("/v1/rl/tasks/t1", headers={"Authorization": f"Bearer {token}"})
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "task_not_found")

    assert await sup.start() == {"status": "running", "failure_reason": None}  # idempotent: same child
    assert (sup.pid, sup.token) == (pid, token)
    assert sup.accepts_hook_encoding("packed-v1") and not sup.accepts_hook_encoding("packed-v2")

    await start_task(endpoint, token, "s1", "t1")
    assert await sup.stop() == {"status": "stopped", "failure_reason": None}
    assert process_gone(pid) and sup.pid is None and sup.token is None
    assert not sup.accepts_hook_encoding("packed-v1")  # no child: the gateway would send JSON
    record = await task_record(redis, "t1")
    assert (record["status"], record["finish_reason"]) == ("finalized", "service_stopped")
    assert await sup.stop() == {"status": "stopped", "failure_reason": None}  # idempotent
    assert (tmp_path / "logs" / "rl-service.stderr.log").exists()
    # The child's output may quote captured text: private to the service's user (issue 19, item 7).
    logs = tmp_path / "logs"
    assert [oct(stat.S_IMODE(p.stat().st_mode)) for p in (logs, logs / "rl-service.stdout.log",
                                                          logs / "rl-service.stderr.log")] == ["0o700", "0o600", "0o600"]


async def test_a_child_serving_another_model_fails_the_start(supervisors, redis, redis_url, tmp_path: Path):
    """The gateway's `onlineRL.modelId` and the child's own `model_id` must agree: the real service configured for
    another model is killed and the start fails with both names; the same model starts."""
    config_path, endpoint = service_config(tmp_path, redis_url)  # model_id: tiny
    sup = supervisors(command=SERVICE, config_path=config_path, endpoint=endpoint, model_id="other-model")
    with pytest.raises(SupervisorError) as failed:
        await sup.start()
    assert "'tiny'" in str(failed.value) and "'other-model'" in str(failed.value)
    assert sup.status()["status"] == "failed" and sup.pid is None
    assert await wait_gone_endpoint(endpoint)

    same = supervisors(command=SERVICE, config_path=config_path, endpoint=endpoint, model_id="tiny")
    assert await same.start() == {"status": "running", "failure_reason": None}
    assert await same.stop() == {"status": "stopped", "failure_reason": None}


async def wait_gone_endpoint(endpoint: str, timeout_s: float = 30.0) -> bool:
    """True once nothing answers on `endpoint` (the killed child's port is free again)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                await client.get(endpoint + "/health", timeout=1.0)
            except httpx.TransportError:
                return True
            await asyncio.sleep(0.1)
    return False


async def test_crash_is_reported_and_restart_recovers(supervisors, redis, redis_url, tmp_path: Path):
    config_path, endpoint = service_config(tmp_path, redis_url)
    reasons: list[str] = []
    reported = asyncio.Event()

    async def on_exit(reason: str) -> None:
        assert sup.status() == {"status": "failed", "failure_reason": reason}  # status first, then the callback
        reasons.append(reason)
        reported.set()

    sup = supervisors(command=SERVICE, config_path=config_path, endpoint=endpoint, on_exit=on_exit)
    await sup.start()
    first_pid, first_token = sup.pid, sup.token
    assert first_pid is not None and first_token is not None
    await start_task(endpoint, first_token, "s1", "t1")

    os.kill(first_pid, signal.SIGKILL)
    async with asyncio.timeout(10):
        await reported.wait()
    assert reasons == ["the RL Service killed by signal SIGKILL"]
    assert sup.status() == {"status": "failed", "failure_reason": reasons[0]}
    assert sup.token is None and sup.pid is None

    assert await sup.start() == {"status": "running", "failure_reason": None}
    assert sup.pid != first_pid and sup.token not in (None, first_token)  # a fresh token per spawn
    record = await task_record(redis, "t1")  # startup recovery of the new child
    assert (record["status"], record["finish_reason"]) == ("aborted", "service_restarted")
    await sup.stop()
    assert reasons == ["the RL Service killed by signal SIGKILL"]  # a requested stop is not a failure


async def test_child_that_exits_fails_fast(supervisors, redis_url, tmp_path: Path):
    config_path, endpoint = service_config(tmp_path, redis_url, listen_host="0.0.0.0")
    called: list[str] = []
    sup = supervisors(command=SERVICE, config_path=config_path, endpoint=endpoint, control_timeout_s=60.0,
                      on_exit=called.append)
    began = time.monotonic()
    with pytest.raises(SupervisorError, match="exited with code 2 during startup"):
        await sup.start()
    assert time.monotonic() - began < 15, "must not wait for the full control timeout"
    status = sup.status()
    assert status["status"] == "failed" and "exited with code 2" in status["failure_reason"]
    assert "rl-service.stderr.log" in status["failure_reason"]
    assert "listen_host" in (tmp_path / "logs" / "rl-service.stderr.log").read_text()
    assert called == [] and sup.pid is None  # a failed start raises; on_exit is for a running child's exit
    assert await sup.stop() == {"status": "stopped", "failure_reason": None}


async def test_child_not_healthy_in_time_is_killed(supervisors, tmp_path: Path):
    pid_file = tmp_path / "sleeper.pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    _, endpoint = stand_in_config(tmp_path)
    sup = supervisors(command=[sys.executable, "-c", sleeper], config_path="unused", endpoint=endpoint,
                      control_timeout_s=1.0)
    began = time.monotonic()
    with pytest.raises(SupervisorError, match="not healthy within 1 s"):
        await sup.start()
    assert time.monotonic() - began < 5
    assert sup.status()["status"] == "failed"
    assert process_gone(int(pid_file.read_text()))


async def test_stop_kills_a_child_that_ignores_sigterm(supervisors, tmp_path: Path):
    config_path, endpoint = stand_in_config(tmp_path)
    sup = supervisors(command=[sys.executable, "-c", STAND_IN, "ignore-term"], config_path=config_path,
                      endpoint=endpoint, control_timeout_s=1.0)
    await sup.start()
    pid = sup.pid
    assert pid is not None
    began = time.monotonic()
    drained: list[bool] = []

    async def drain() -> None:
        drained.append(sup.status()["status"] == "running")  # drain runs first, while the child still serves

    assert await sup.stop(drain) == {"status": "stopped", "failure_reason": None}
    assert drained == [True] and 1.0 <= time.monotonic() - began < 5
    assert process_gone(pid)


async def test_endpoint_served_by_another_process_is_refused(supervisors, tmp_path: Path):
    config_path, endpoint = stand_in_config(tmp_path)
    first = supervisors(command=[sys.executable, "-c", STAND_IN], config_path=config_path, endpoint=endpoint)
    await first.start()
    second = supervisors(command=[sys.executable, "-c", STAND_IN], config_path=config_path, endpoint=endpoint)
    with pytest.raises(SupervisorError, match="already served by another process"):
        await second.start()
    assert second.status()["status"] == "failed" and second.pid is None
    assert first.status()["status"] == "running"


async def test_spawn_failure(supervisors, tmp_path: Path):
    sup = supervisors(command=[str(tmp_path / "no-such-binary")], config_path="x", endpoint=stand_in_config(tmp_path)[1])
    with pytest.raises(SupervisorError, match="cannot spawn the RL Service"):
        await sup.start()
    assert sup.status()["status"] == "failed"


@pytest.mark.parametrize("child", ["service", "stand-in"])
async def test_child_dies_with_the_gateway(redis_url, tmp_path: Path, child: str):
    if child == "service":  # the real service also has its own 1 s getppid() watchdog
        command = SERVICE
        config_path, endpoint = service_config(tmp_path, redis_url)
    else:  # no watchdog of its own: only the parent-death signal set by the supervisor can end it
        command = [sys.executable, "-c", STAND_IN]
        config_path, endpoint = stand_in_config(tmp_path)
    gateway = await asyncio.create_subprocess_exec(
        sys.executable, "-c", GATEWAY, orjson.dumps(command).decode(), config_path, endpoint,
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    child_pid: int | None = None
    try:
        assert gateway.stdout is not None
        async with asyncio.timeout(30):
            line = await gateway.stdout.readline()
        assert line.strip(), "the gateway stand-in did not report its child"
        child_pid = int(line)
        assert not process_gone(child_pid)
        gateway.kill()  # SIGKILL: no chance to clean up
        async with asyncio.timeout(10):
            await gateway.wait()
        assert await wait_gone(child_pid, 5.0) < 5.0
    finally:
        if gateway.returncode is None:
            gateway.kill()
            await gateway.wait()
        if child_pid is not None and not process_gone(child_pid):
            os.killpg(child_pid, signal.SIGKILL)  # the group this test's gateway created


async def test_a_child_whose_health_lists_no_encodings_gets_json(supervisors, tmp_path: Path):
    """A service that predates `hook_encodings` (the stand-in's `/health` has no body) is sent the JSON `:after`."""
    config_path, endpoint = stand_in_config(tmp_path)
    sup = supervisors(command=[sys.executable, "-c", STAND_IN], config_path=config_path, endpoint=endpoint)
    assert (await sup.start())["status"] == "running"
    assert not sup.accepts_hook_encoding("packed-v1")
    await sup.stop()
