"""Secrets never reach logs, answers or stored data (ARCHITECTURE "Rules of the house", CONTRACT §2.1, §3.2).

The gateway (DEBUG logging) and its RL Service child (DEBUG) run with distinctive secrets: both HMAC keys, the
child's bearer token (minted by the gateway, read from the child's environment), the Judge API key and a Redis
password inside `redis_url`. The test drives the paths most likely to log something: forged, stale and replayed
control calls, a wrong bearer token on the gateway's internal routes, a Judge failing, a Training Run with its
activation, a service stop and restart. Then it greps every file the processes wrote, every HTTP answer received and
every value in Redis for each secret.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import openai
import pytest
from redis.asyncio import Redis

from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import sign_request
from tests.support.fake_judge import FakeJudge, Status
from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.support.load import child_pid

pytestmark = pytest.mark.system

API_KEY = b"apiK-7e3f91c2a8b4d6e0f1a2b3c4d5e6"
INS_KEY = b"insK-0c9b8a7f6e5d4c3b2a1f0e9d8c7b"
JUDGE_KEY = "sk-judge-4f1e9a7c3b2d-secret"
REDIS_PASSWORD = "pw-a81c4e7f2b9d-secret"
SERVICE_MODULE = "openjiuwen.agent_evolving.agent_rl.online.service"
CONFIG_FILES = {"hmac.json", "gateway.json", "rl-service.yaml"}  # where the operator put the secrets on purpose


def with_password(redis_url: str) -> str:
    """The same Redis with a password in the URL (`AUTH default <pw>` succeeds while the default user is nopass)."""
    parts = urlsplit(redis_url)
    return urlunsplit(parts._replace(netloc=f"default:{REDIS_PASSWORD}@{parts.hostname}:{parts.port}"))


def child_token(gateway_pid: int) -> str:
    environ = Path(f"/proc/{child_pid(gateway_pid, SERVICE_MODULE)}/environ").read_bytes().split(b"\0")
    token = next(e.split(b"=", 1)[1] for e in environ if e.startswith(b"RL_SERVICE_TOKEN="))
    assert len(token) >= 16
    return token.decode()


async def redis_values(redis: Redis) -> list[bytes]:
    out: list[bytes] = []
    async for key in redis.scan_iter(match="*"):
        out.append(key)
        kind = (await redis.type(key)).decode()
        if kind == "string":
            out.append(await redis.get(key) or b"")
        elif kind == "hash":
            out.extend(v for kv in (await redis.hgetall(key)).items() for v in kv)
        elif kind == "set":
            out.extend(await redis.smembers(key))
        elif kind == "zset":
            out.extend(await redis.zrange(key, 0, -1))
        elif kind == "list":
            out.extend(await redis.lrange(key, 0, -1))
        elif kind == "stream":
            out.extend(v for _, fields in await redis.xrange(key) for kv in fields.items() for v in kv)
    return out


async def test_no_secret_in_logs_answers_or_redis(redis: Redis, redis_url: str, tmp_path: Path) -> None:
    answers: list[str] = []
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm, FakeJudge() as judge, GatewayProcess(
        tmp_path, with_password(redis_url), instances=[vllm], judge_url=judge.url, log_level="DEBUG",
        api_key=API_KEY, ins_key=INS_KEY,
        rl_overrides={"judge_api_key": JUDGE_KEY, "log_level": "DEBUG", "min_samples_for_training": 1},
    ) as gw:
        def keep(r: httpx.Response) -> httpx.Response:
            answers.append(r.text)
            return r

        gw.start_service()
        assert gw.proc is not None
        token = child_token(gw.proc.pid)
        agent = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)

        # Refused control calls: forged, stale, unsigned, replayed, wrong bearer on the internal routes.
        body = b'{"reward_mode": "terminal"}'
        now_ms = int(time.time() * 1000)
        start = "/v1/rl/tasks/start"
        for headers in (sign_request(b"f" * 32, "POST", start, body, now_ms=now_ms),
                        sign_request(API_KEY, "POST", start, body, now_ms=now_ms - 600_000), {}):
            r = keep(gw.http.post(start, content=body, headers={**headers, "X-Agent-Session-Id": "s0",
                                                                "content-type": "application/json"}))
            assert r.status_code == 401
        signed = sign_request(API_KEY, "GET", "/v1/rl/service", b"", now_ms=now_ms)
        assert keep(gw.http.get("/v1/rl/service", headers=signed)).status_code == 200
        assert keep(gw.http.get("/v1/rl/service", headers=signed)).status_code == 401  # replayed
        for bearer in ("Bearer wrong", f"Bearer {token}x", token):
            r = keep(gw.http.get("/internal/v1/rl/loras/tiny", headers={"Authorization": bearer}))
            assert r.status_code == 401

        # A terminal Task, rewarded; a delayed Task whose Judge fails (logged by the service, 502 to the agent).
        r = keep(gw.start_task("s1"))
        t1 = r.json()["rl_task_id"]
        agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                      extra_headers={"X-Agent-Session-Id": "s1"})
        assert keep(gw.signed("POST", f"/v1/rl/tasks/{t1}/stop")).status_code == 200
        assert keep(gw.signed("POST", f"/v1/rl/tasks/{t1}/reward", json={"reward": 0.5})).status_code == 200
        assert keep(gw.start_task("s2", "delayed_feedback")).status_code == 201
        judge.enqueue(Status(500), Status(500), Status(500))
        for turn in ("u1", "u2"):
            try:
                agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": turn}],
                                              extra_headers={"X-Agent-Session-Id": "s2", "X-Agent-Turn-Id": turn})
            except openai.APIStatusError as exc:
                answers.append(exc.response.text)
                assert exc.status_code == 502

        # A Training Run: the child calls the gateway's internal routes with its token; then stop and restart.
        r = keep(gw.signed("POST", "/v1/rl/training/runs"))
        assert r.status_code == 201, r.text
        run = r.json()["training_run_id"]
        deadline = time.monotonic() + 30
        while keep(gw.signed("GET", f"/v1/rl/training/runs/{run}")).json()["status"] not in (
                "succeeded", "failed", "canceled"):
            assert time.monotonic() < deadline, "training run did not end"
            time.sleep(0.1)
        assert keep(gw.signed("GET", f"/v1/rl/training/runs/{run}")).json()["status"] == "succeeded"
        assert keep(gw.signed("POST", "/v1/rl/service/stop")).status_code == 200
        gw.start_service()
        assert keep(gw.signed("GET", "/v1/rl/trajectories/stats")).status_code == 200
        token_after_restart = child_token(gw.proc.pid)

    secrets = {
        "api HMAC key": API_KEY.decode(), "instance HMAC key": INS_KEY.decode(), "RL bearer token": token,
        "RL bearer token (restart)": token_after_restart, "Judge API key": JUDGE_KEY, "Redis password": REDIS_PASSWORD,
    }
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.name not in CONFIG_FILES]
    names = {p.name for p in files}
    assert {"gateway.stderr.log", "rl-service.log", "rl-service.stderr.log"} <= names, names
    assert " DEBUG " in (gw.dir / "gateway.stderr.log").read_text()  # everything the gateway's libraries log, too
    assert "judge" in (gw.dir / "rl-service.log").read_text().lower()  # the Judge failure was logged
    assert judge.requests and judge.requests[0].authorization == f"Bearer {JUDGE_KEY}"  # the key was in use
    stored = b"\n".join(await redis_values(redis))
    for what, secret in secrets.items():
        for path in files:
            assert secret.encode() not in path.read_bytes(), f"the {what} leaked into {path}"
        for text in answers:
            assert secret not in text, f"the {what} leaked into an HTTP answer"
        assert secret.encode() not in stored, f"the {what} is stored in Redis"
