"""Agent keys against real processes (issue 28 item 3): a gateway with its RL Service child, a private Redis and a
fake vLLM on loopback sockets. The attacker holds one agent key (what every agent that starts Tasks or uploads rail
batches is given) and tries every signed route, and another agent's Tasks.

An agent key may start, stop and reward Tasks and upload rail batches; every other signed route answers 403
`key_not_permitted` and does nothing. Within that, a Task started with one agent key is unknown to another (404
`task_not_found`, no drain, no abort), while the operator key reaches every Task.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.fake_vllm import CHAT_PATH, FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.unit.test_contract_doc import app_routes

pytestmark = pytest.mark.system

AGENT_ROUTES = {
    ("POST", "/v1/rl/tasks/start"),
    ("POST", "/v1/rl/tasks/{rl_task_id}/stop"),
    ("POST", "/v1/rl/tasks/{rl_task_id}/reward"),
    ("POST", "/v1/gateway/upload/batch"),
}
UNSIGNED = {("GET", "/aigw/v1/health"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"), ("POST", "/v1/messages")}
PATH_VALUES = {"rl_task_id": "t" + "0" * 32, "training_run_id": "run-000000000001", "trajectory_id": "s:0",
               "rollout_id": "ro-000000000001", "model": "tiny", "lineage": "default"}
CHAT_BODY = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def vllm() -> Iterator[FakeVLLM]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as v:
        yield v


def error_code(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def signed_gateway_routes(tmp: Path) -> set[tuple[str, str]]:
    """Every signed route the gateway serves, read from its app (as `openjiuwen-rl gateway` builds it)."""
    from openjiuwen.agent_evolving.agent_rl.gateway.app import build_gateway, create_gateway_app
    from openjiuwen.agent_evolving.agent_rl.gateway.config import gateway_config_from_mapping
    from openjiuwen.agent_evolving.agent_rl.gateway.auth.hmac_auth import HmacVerifier
    from openjiuwen.agent_evolving.agent_rl.gateway.console.console_auth import ConsoleAuth

    config = gateway_config_from_mapping({
        "global": {"hmacKeyFile": str(tmp / "keys.json")},
        "lora": {"root": str(tmp / "loras"), "statePath": str(tmp / "lora-state.json")},
        "onlineRL": {"command": ["python"], "configPath": str(tmp / "rl.yaml"), "modelId": "tiny"},
    })
    key = b"k" * 32
    app = create_gateway_app(build_gateway(config, verifier=HmacVerifier(key), console_auth=ConsoleAuth(key), env={}))
    routes = set(app_routes(app.routes))
    return {(m, p) for m, p in routes if (m, p) not in UNSIGNED and not p.startswith(("/internal/", "/console"))}


def concrete(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PATH_VALUES[m.group(1)], path)


def bodies(vllm: FakeVLLM) -> dict[str, dict]:
    """What an operator would send on each route, so that only the key decides whether anything happens."""
    return {
        "/aigw/v1/register-instance": {"name": "rogue", "model": "tiny", "instanceIp": "127.0.0.1",
                                       "port": vllm.port},
        "/aigw/v1/unregister-instance": {"name": vllm.name},
        "/v1/rl/loras/activate": {"lora_name": "tiny:v1"},
        "/v1/rl/trajectories/rewards": {"rewards": [{"trajectory_id": "s:0", "source": "human", "score": 1}]},
        "/v1/rl/trajectories/s:0/rewards": {"source": "human", "score": 1},
    }


def test_an_agent_key_is_refused_on_every_signed_route_but_its_own(redis, redis_url, tmp_path, vllm):
    routes = signed_gateway_routes(tmp_path / "app")
    assert AGENT_ROUTES < routes and len(routes) >= 30  # the app still serves them, and many more
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        before = {"instances": gw.signed("GET", "/aigw/v1/instances").json(),
                  "lora": gw.signed("GET", "/v1/loras/tiny").json()}
        known = bodies(vllm)
        for method, path in sorted(routes - AGENT_ROUTES):
            target = concrete(path)
            body = known.get(target, {} if method == "POST" else None)
            r = gw.signed(method, target, json=body, agent="agent-a")
            assert error_code(r) == (403, "key_not_permitted"), (method, path, r.text)
            assert "agent-a" in r.json()["error"]["message"]
        # Nothing happened: the service still runs, no instance came or went, no version moved, no run started.
        assert gw.signed("GET", "/v1/rl/service").json()["status"] == "running"
        assert gw.signed("GET", "/aigw/v1/instances").json() == before["instances"]
        assert gw.signed("GET", "/v1/loras/tiny").json() == before["lora"]
        assert gw.signed("GET", "/v1/rl/training/runs").json()["items"] == []
        assert gw.signed("GET", "/v1/rl/lineages/default").json()["paused"] is False
        assert not any(r.path.endswith("load_lora_adapter") for r in vllm.requests)
        # Its own four routes take it (each answer comes from the RL Service, past the signature).
        started = gw.start_task("own-session", agent="agent-a")
        assert started.status_code == 201 and started.json()["agent_key_id"] == "agent-a"
        task = started.json()["rl_task_id"]
        stopped = gw.signed("POST", f"/v1/rl/tasks/{task}/stop", agent="agent-a")
        assert stopped.json()["status"] == "finalized"
        rewarded = gw.signed("POST", f"/v1/rl/tasks/{task}/reward", json={"reward": 1.0}, agent="agent-a")
        assert error_code(rewarded) == (409, "reward_conflict")  # the reward rules: no capture in that Task
        upload = gw.signed("POST", "/v1/gateway/upload/batch", agent="agent-a", json={
            "protocol_version": "rail-v1", "session_id": "rail-s", "trajectory_id": "rail-t", "samples": []})
        assert error_code(upload) == (400, "judge_not_configured")  # this RL Service has no Judge
        # A key id the gateway does not hold, or an agent key under another id, is simply an invalid signature.
        forged = gw.signed_request("GET", "/v1/rl/service", agent="agent-a")
        forged.headers["X-Key-Id"] = "agent-b"
        assert error_code(gw.http.send(forged)) == (401, "invalid_signature")


def captured(gw: GatewayProcess, session: str) -> httpx.Response:
    return httpx.post(gw.url + CHAT_PATH, json=CHAT_BODY, headers={"X-Agent-Session-Id": session}, timeout=30)


def test_an_agent_key_stops_and_rewards_only_the_tasks_it_started(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        started = gw.start_task("session-a", agent="agent-a")
        assert started.status_code == 201
        task = started.json()["rl_task_id"]
        # A capture of agent A's Task is in flight (vLLM holds it) when agent B tries to stop that Task.
        vllm.delay_next(CHAT_PATH, 3.0)
        answers: list[httpx.Response] = []
        inflight = threading.Thread(target=lambda: answers.append(captured(gw, "session-a")))
        inflight.start()
        vllm.wait_until(lambda v: v.count(CHAT_PATH) == 1)
        r = gw.signed("POST", f"/v1/rl/tasks/{task}/stop", agent="agent-b")
        assert error_code(r) == (404, "task_not_found")
        assert inflight.is_alive()  # answered at once: B's stop neither drained A's Task nor timed it out
        r = gw.signed("POST", f"/v1/rl/tasks/{task}/reward", json={"reward": 1.0}, agent="agent-b")
        assert error_code(r) == (404, "task_not_found")
        r = gw.start_task("session-a", agent="agent-b")  # nor can B take over or learn of A's session
        assert error_code(r) == (409, "task_conflict") and task not in r.text
        assert error_code(gw.signed("GET", f"/v1/rl/tasks/{task}", agent="agent-b")) == (403, "key_not_permitted")
        inflight.join(30)
        assert answers[0].status_code == 200, answers[0].text
        assert captured(gw, "session-a").status_code == 200  # A's session is still mapped: captured too
        record = gw.signed("GET", f"/v1/rl/tasks/{task}").json()
        assert (record["status"], record["agent_key_id"]) == ("active", "agent-a")
        events = gw.signed("GET", f"/v1/rl/tasks/{task}/events").json()["items"]
        assert sum(e["type"] == "capture_committed" for e in events) == 2
        # The owner stops and rewards it; B still cannot.
        assert gw.signed("POST", f"/v1/rl/tasks/{task}/stop", agent="agent-a").json()["status"] == "finalized"
        r = gw.signed("POST", f"/v1/rl/tasks/{task}/reward", json={"reward": 1.0}, agent="agent-b")
        assert error_code(r) == (404, "task_not_found")
        r = gw.signed("POST", f"/v1/rl/tasks/{task}/reward", json={"reward": 1.0}, agent="agent-a")
        assert r.json() == {"sample_count": 2}
        # The operator key reaches any agent's Task, and an operator's Task is unknown to every agent key.
        other = gw.start_task("session-b", agent="agent-b").json()["rl_task_id"]
        assert gw.signed("POST", f"/v1/rl/tasks/{other}/stop").json()["status"] == "finalized"
        mine = gw.start_task("session-op").json()
        assert mine["agent_key_id"] is None
        r = gw.signed("POST", f"/v1/rl/tasks/{mine['rl_task_id']}/stop", agent="agent-a")
        assert error_code(r) == (404, "task_not_found")
