"""The RL Service as a real process (CONTRACT §2.1: process, watchdog, startup, shutdown; §9 lifecycle checklist).

Each test starts `python -m …online.service --config FILE` against the session's private Redis, talks to it over
its loopback socket and reads the stored state straight from Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.conftest import load_fixture
from tests.support.fake_judge import FakeJudge, Status
from tests.support.service_app import start_headers
from tests.support.service_process import ServiceProcess, process_gone

pytestmark = pytest.mark.system

TOKEN = "tok-7f3c2a9e5b1d-secret"
REDIS_PASSWORD = "pw-4e8a1c6f-secret"
JUDGE_KEY = "sk-judge-0b9d2e-secret"


def with_password(redis_url: str) -> str:
    """The same Redis with credentials in the URL: `AUTH default <pw>` succeeds while the default user is nopass
    (Redis >= 6), so the service really carries a password it must never log."""
    parts = urlsplit(redis_url)
    return urlunsplit(parts._replace(netloc=f"default:{REDIS_PASSWORD}@{parts.hostname}:{parts.port}"))


async def task_record(redis, t: str) -> dict:
    raw = await redis.get(keys.task(t))
    assert raw is not None, f"no record for task {t}"
    return orjson.loads(raw)


async def start(client: httpx.AsyncClient, session: str, t: str, mode: str = "terminal") -> None:
    r = await client.post("/v1/rl/tasks/start", json={"reward_mode": mode}, headers=start_headers(session, t))
    assert r.status_code == 201, r.text


async def before(client: httpx.AsyncClient, t: str, c: str, turn: str | None = None) -> dict:
    body = {"rl_task_id": t, "capture_id": c, "agent_turn_id": turn, "request": load_fixture("chat_request.json")}
    r = await client.post("/internal/v1/completions:before", json=body)
    assert r.status_code == 200, r.text
    return r.json()["request"]


async def commit(client: httpx.AsyncClient, t: str, c: str, turn: str | None = None) -> None:
    injected = await before(client, t, c, turn)
    body = {
        "rl_task_id": t, "capture_id": c, "agent_turn_id": turn, "request": injected,
        "response": load_fixture("chat_response.json"),
    }
    r = await client.post("/internal/v1/completions:after", json=body)
    assert r.status_code == 204, r.text


def assert_no_secrets(svc: ServiceProcess, *secrets: str) -> None:
    for name, text in (("log", svc.log()), ("stderr", svc.stderr()), ("stdout", svc.stdout_path.read_text())):
        for secret in secrets:
            assert secret not in text, f"a secret leaked into the service {name}"


async def test_sigterm_finishes_or_aborts_every_task(redis, redis_url, tmp_path: Path):
    with FakeJudge(default=Status(500)) as judge, ServiceProcess(
        tmp_path, with_password(redis_url), judge_endpoint=judge.url, judge_model="judge", judge_api_key=JUDGE_KEY,
        judge_retries=0, judge_timeout=5.0,
    ) as svc:
        async with httpx.AsyncClient(base_url=svc.url, timeout=10) as client:
            await start(client, "s1", "t1")
            await commit(client, "t1", "c1")  # committed capture: finishes and then awaits its reward
            await start(client, "s2", "t2")
            await before(client, "t2", "c1")  # open capture: finish is a conflict, so it is aborted
            await start(client, "s3", "t3")  # nothing captured: finishes
            await start(client, "s4", "t4", mode="delayed_feedback")
            await commit(client, "t4", "c1", turn="u1")  # the final publication meets a failing Judge
        # A record nobody can decode: both finish and abort raise. Sorted first, it must not block the others.
        await redis.set(keys.task("t0"), b"\x00 not a task")
        await redis.sadd(keys.ACTIVE_TASKS, "t0")

        began = time.monotonic()
        svc.sigterm()
        assert svc.wait(10) == 0, svc.output()
        assert time.monotonic() - began < 5, "graceful shutdown took too long"
        assert_no_secrets(svc, TOKEN, REDIS_PASSWORD, JUDGE_KEY)
        assert len(judge.requests) == 1  # the delayed Task's last turn was really sent to the Judge

    t1, t2, t3, t4 = [await task_record(redis, t) for t in ("t1", "t2", "t3", "t4")]
    assert (t1["status"], t1["finish_reason"]) == ("finalized", "service_stopped")
    assert (t2["status"], t2["finish_reason"]) == ("aborted", "service_stopped")
    assert (t3["status"], t3["finish_reason"]) == ("finalized", "service_stopped")
    # A Judge failure in the final publication has already aborted it `capture_failed`, which is kept.
    assert (t4["status"], t4["finish_reason"]) == ("aborted", "capture_failed")
    assert await redis.zscore(keys.TASKS_AWAITING_REWARD, "t1") is not None
    assert not await redis.exists(keys.capture("t2", "c1"))
    assert not await redis.exists(keys.open_captures("t2"))
    assert await redis.smembers(keys.ACTIVE_TASKS) == {b"t0"}  # only the undecodable one is left
    for s in ("s1", "s2", "s3", "s4"):
        assert not await redis.exists(keys.active_session(s))
    log = svc.log()
    assert "t0 could not finish at shutdown" in log and "t0 could not be aborted at shutdown" in log


async def test_sigkill_mid_workload_then_restart_recovers(redis, redis_url, tmp_path: Path):
    svc = ServiceProcess(tmp_path, with_password(redis_url))
    with svc:
        async with httpx.AsyncClient(base_url=svc.url, timeout=10) as client:
            # tA: a published sample (capture, stop, reward) before the crash.
            await start(client, "sA", "tA")
            await commit(client, "tA", "cA")
            assert (await client.post("/v1/rl/tasks/tA/stop")).json()["status"] == "finalized"
            assert (await client.post("/v1/rl/tasks/tA/reward", json={"reward": 1.0})).json() == {"sample_count": 1}
            await start(client, "sB", "tB")
            await before(client, "tB", "c1")  # open capture
            await start(client, "sC", "tC")
            await commit(client, "tC", "c1")  # staged sample, never rewarded
            await start(client, "sD", "tD")
            await start(client, "sE", "tE")

            async def workload() -> None:  # captures on tE until the service dies under it
                i = 0
                with contextlib.suppress(httpx.TransportError):
                    while True:
                        await commit(client, "tE", f"w{i}")
                        i += 1

            running = asyncio.create_task(workload())
            try:
                async with asyncio.timeout(10):
                    while await redis.scard(keys.committed_captures("tE")) < 3:
                        await asyncio.sleep(0.01)
                svc.sigkill()
                assert svc.wait(5) == -9
                async with asyncio.timeout(10):
                    await running  # the next request fails at the transport: nothing was answered late
            finally:
                running.cancel()
        # A stale index entry (a finished Task) and a ghost id: recovery removes both without touching tA.
        await redis.sadd(keys.ACTIVE_TASKS, "tA", "ghost")
        assert (await task_record(redis, "tB"))["status"] == "active"  # a crash ran no shutdown

        svc.start()  # the same config file, port and log
        async with httpx.AsyncClient(base_url=svc.url, timeout=10) as client:
            for t in ("tB", "tC", "tD", "tE"):
                body = (await client.get(f"/v1/rl/tasks/{t}")).json()
                assert (body["status"], body["finish_reason"]) == ("aborted", "service_restarted"), t
            body = (await client.get("/v1/rl/tasks/tA")).json()
            assert (body["status"], body["finish_reason"]) == ("finalized", "user_stopped")
            assert await redis.smembers(keys.ACTIVE_TASKS) == set()
            detail = await client.get("/v1/rl/trajectories/cA")
            assert detail.status_code == 200 and detail.json()["judge"] == {"score": 1.0, "source": "terminal"}
            stats = (await client.get("/v1/rl/trajectories/stats")).json()
            assert (stats["total"], stats["by_status"]["pending"]) == (1, 1)
            for t in ("tB", "tC", "tE"):  # aborting removed every open capture and staged sample
                assert not await redis.exists(keys.open_captures(t))
                assert [k async for k in redis.scan_iter(match=f"rl:v1:task:{t}:pending:*")] == []
            assert not await redis.exists(keys.capture("tB", "c1"))
            # The recovered service works: the sessions are free again.
            await start(client, "sB", "tB2")

        log = svc.log()
        assert "startup recovery aborted 4 active task(s) with service_restarted" in log
        assert_no_secrets(svc, REDIS_PASSWORD)


async def test_service_exits_when_its_parent_dies(redis, redis_url, tmp_path: Path):
    with ServiceProcess(tmp_path, redis_url, via_parent=True) as svc:
        async with httpx.AsyncClient(base_url=svc.url, timeout=10) as client:
            await start(client, "s1", "t1")
        assert svc.pid != svc.parent_pid and not process_gone(svc.pid)
        svc.kill_parent()
        assert svc.wait_gone(5) <= 5
        with pytest.raises(httpx.TransportError):
            httpx.get(svc.url + "/health", timeout=1)
    # It behaved like a crash (no graceful shutdown): the Task is left for startup recovery.
    assert (await task_record(redis, "t1"))["status"] == "active"


async def test_owner_mismatch_refuses_to_start(redis, redis_url, tmp_path: Path):
    await redis.set(keys.OWNER, "other")
    await redis.sadd(keys.ACTIVE_TASKS, "ghost")  # recovery would drop it: proves startup stopped before step 2
    with ServiceProcess(tmp_path, redis_url).start(wait_ready=False) as svc:
        deadline = time.monotonic() + 20
        with httpx.Client(timeout=0.5) as client:
            while svc.proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(httpx.TransportError):
                    assert client.get(svc.url + "/health").status_code != 200, "served despite the owner mismatch"
                time.sleep(0.05)
        assert svc.wait(1) not in (0, None), svc.output()
        assert "another model id" in svc.stderr() + svc.log()
    assert await redis.get(keys.OWNER) == b"other"
    assert await redis.smembers(keys.ACTIVE_TASKS) == {b"ghost"}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
async def test_non_loopback_listen_host_is_refused(redis, redis_url, tmp_path: Path, host: str):
    with ServiceProcess(tmp_path, redis_url, listen_host=host).start(wait_ready=False) as svc:
        assert svc.wait(20) != 0
        assert "listen_host" in svc.stderr()
    assert await redis.get(keys.OWNER) is None  # refused before touching Redis


async def test_bearer_token_guards_every_route_but_health(redis, redis_url, tmp_path: Path):
    env = {"RL_SERVICE_TOKEN": TOKEN}
    with ServiceProcess(tmp_path, with_password(redis_url), env=env) as svc:
        async with httpx.AsyncClient(base_url=svc.url, timeout=10) as client:
            health = await client.get("/health")
            assert (health.status_code, health.json()) == (200, {"status": "ready", "model_id": "tiny",
                                                                 "hook_encodings": ["json", "packed-v1"]})
            good = {"Authorization": f"Bearer {TOKEN}"}
            for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": f"Basic {TOKEN}"}):
                for method, path in (("GET", "/v1/rl/trajectories/stats"), ("GET", "/v1/rl/tasks/t1"),
                                     ("POST", "/v1/rl/tasks/start"), ("POST", "/internal/v1/completions:before"),
                                     ("GET", "/no/such/route"), ("POST", "/health")):
                    r = await client.request(method, path, headers=bad, json={"reward_mode": "terminal"})
                    assert r.status_code == 401, (method, path, bad)
                    assert r.json() == {"error": {"code": "unauthorized", "message": r.json()["error"]["message"]}}
                    assert TOKEN not in r.text
            assert (await client.get("/v1/rl/trajectories/stats", headers=good)).status_code == 200
            r = await client.post(
                "/v1/rl/tasks/start", json={"reward_mode": "terminal"}, headers={**good, **start_headers("s1", "t1")}
            )
            assert r.status_code == 201
            assert (await client.get("/v1/rl/tasks/t1", headers=good)).json()["status"] == "active"
        svc.sigterm()
        assert svc.wait(10) == 0, svc.output()
    # Business logs go to log_path only: nothing propagates to the console, and uvicorn prints no access log.
    assert "RL service ready for model tiny" in svc.log()
    assert svc.stdout_path.read_text() == ""
    assert "RL service ready" not in svc.stderr() and "/v1/rl/tasks/start" not in svc.stderr()
    assert_no_secrets(svc, TOKEN, REDIS_PASSWORD)
