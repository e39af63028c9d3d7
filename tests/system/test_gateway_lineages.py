"""Lineages through the real gateway process (docs/lineages.md "## Gateway"): lines activated through the internal
routes, adapter paging on an instance with 2 slots and 5 lines, a restart, and the Task start's lineage, against a
strict fake vLLM (refuses a 3rd adapter) and a fake RL child that records what the gateway forwards.

The Task start is checked against the fake child only: the real RL Service learns lineages in its own branch, so the
end-to-end Task of another lineage is tested after the merge."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.fake_vllm import CHAT_PATH, FakeVLLM
from tests.support.gateway_process import API_KEY, INS_KEY, GatewayProcess, write_key_file

pytestmark = pytest.mark.system

LINEAGES = ["l1", "l2", "l3", "l4", "l5"]
CHILD = Path(__file__).resolve().parents[1] / "support" / "fake_rl_child.py"


@pytest.fixture
def vllm() -> Iterator[FakeVLLM]:
    with FakeVLLM(served_model="tiny", name="vllm-a", max_loras=2) as v:
        yield v


def gateway(tmp_path: Path, redis_url: str, vllm: FakeVLLM) -> GatewayProcess:
    # The lines are open (`openLineages`): anyone may name their active versions outside a Task, as the default
    # line's (docs/lineages.md "Private lines"); one slot of the two stays reserved for Tasks.
    gw = GatewayProcess(tmp_path, redis_url, instances=[vllm], lora_overrides={"maxLorasPerInstance": 2,
                                                                               "pageTimeout": "10s",
                                                                               "openLineages": LINEAGES},
                        online_overrides={"command": [sys.executable, str(CHILD)]})
    gw.env.update(FAKE_CHILD_PORT=str(gw.rl_port), FAKE_CHILD_OUT=str(tmp_path / "starts.jsonl"),
                  FAKE_CHILD_TOKEN=str(tmp_path / "token"))
    return gw


def internal(gw: GatewayProcess, tmp_path: Path, method: str, path: str, body: dict | None = None) -> httpx.Response:
    token = (tmp_path / "token").read_text()
    return gw.http.request(method, "/internal/v1/rl" + path, json=body, headers={"Authorization": f"Bearer {token}"})


def artifact(gw: GatewayProcess, lineage: str) -> str:
    path = gw.lora_root / "tiny" / lineage / "v1"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def child_calls(tmp_path: Path) -> list[dict]:
    """Every call the fake RL child received (but `/health`), in order."""
    return [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]


def chat(gw: GatewayProcess, model: str) -> httpx.Response:
    return gw.http.post("/v1/chat/completions", json={"model": model, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": model}]})


def test_five_lines_page_through_two_slots_each_served_by_its_own_adapter_and_survive_a_restart(
        tmp_path, redis_url, vllm) -> None:
    with gateway(tmp_path, redis_url, vllm) as gw:
        gw.start_service()
        for lineage in LINEAGES:
            r = internal(gw, tmp_path, "POST", "/loras/activate", {
                "base_model": "/models/tiny", "lora_name": f"tiny:{lineage}:v1",
                "lora_path": artifact(gw, lineage), "expected_lora_name": "base"})
            assert r.status_code == 200, r.text
        # Line parsing in the route's `{model}` position.
        assert internal(gw, tmp_path, "GET", "/loras/tiny:l3").json()["active_lora"]["lora_name"] == "tiny:l3:v1"
        assert internal(gw, tmp_path, "GET", "/loras/tiny").json()["status"] == "base"  # the default line: today's
        assert internal(gw, tmp_path, "GET", "/loras/tiny:v2").json()["error"]["code"] == "invalid_lineage"
        assert internal(gw, tmp_path, "GET", "/loras/other:l1").json()["error"]["code"] == "model_not_found"
        r = internal(gw, tmp_path, "POST", "/loras/activate", {
            "base_model": "/models/tiny", "lora_name": "other:l1:v1", "lora_path": artifact(gw, "l1"),
            "expected_lora_name": "base"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_lora_name")
        assert gw.signed("GET", "/v1/loras/tiny:l5").json()["active_lora"]["lora_name"] == "tiny:l5:v1"

        mark = len(vllm.requests)
        models = [f"tiny:{lineage}:v1" for lineage in LINEAGES] * 6
        with ThreadPoolExecutor(max_workers=10) as pool:
            answers = list(pool.map(lambda m: chat(gw, m), models))
        assert [a.status_code for a in answers] == [200] * len(models), [a.text for a in answers if a.is_error]
        served = [r.body["model"] for r in vllm.requests[mark:] if r.path == CHAT_PATH]
        assert sorted(served) == sorted(models)  # each request reached vLLM for its own adapter, no other, no base
        assert vllm.peak_loaded == 2  # the strict fake refuses a 3rd: the gateway unloaded to make room
        metrics = gw.http.get("/metrics").text
        assert "gw_lora_adapter_evictions_total" in metrics

    with gateway(tmp_path, redis_url, vllm) as gw:  # restart: every line keeps its active version
        for lineage in LINEAGES:
            status = gw.signed("GET", f"/v1/loras/tiny:{lineage}").json()
            assert status["active_lora"]["lora_name"] == f"tiny:{lineage}:v1"
        assert chat(gw, "tiny:l1:v1").status_code == 200
        assert vllm.peak_loaded == 2


def test_task_start_sends_its_lineage_and_takes_the_policy_of_its_line(tmp_path, redis_url, vllm) -> None:
    gw = gateway(tmp_path, redis_url, vllm)
    write_key_file(gw.key_file, {  # agent-a may use `support` only; agent-b every lineage
        "apiHmacKey": API_KEY.decode(), "insHmacKey": INS_KEY.decode(),
        "agentHmacKeys": [{"id": "agent-a", "key": gw.agent_keys["agent-a"].hex(), "lineages": ["support"]},
                          {"id": "agent-b", "key": gw.agent_keys["agent-b"].hex(), "maxLineages": 7}]})
    with gw:
        gw.start_service()
        r = internal(gw, tmp_path, "POST", "/loras/activate", {
            "base_model": "/models/tiny", "lora_name": "tiny:support:v1", "lora_path": artifact(gw, "support"),
            "expected_lora_name": "base"})
        assert r.status_code == 200, r.text

        def start(body: dict, session: str, agent: str | None = None) -> httpx.Response:
            return gw.signed("POST", "/v1/rl/tasks/start", json=body, headers={"X-Agent-Session-Id": session},
                             agent=agent)

        assert start({"reward_mode": "terminal", "lineage": "support"}, "s1", "agent-a").status_code == 201
        assert start({"reward_mode": "terminal"}, "s2", "agent-b").status_code == 201
        refused = start({"lineage": "default"}, "s3", "agent-a")
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "lineage_forbidden")
        invalid = start({"lineage": "Bad Name"}, "s4")
        assert (invalid.status_code, invalid.json()["error"]["code"]) == (400, "invalid_lineage")

        # The session's active Task is of `support`: a start of another lineage there is refused by the gateway
        # even when the RL Service answers that Task (it is never bound under the lineage the start named).
        other = start({"reward_mode": "terminal"}, "s1")  # the operator, no lineage: `default`
        assert (other.status_code, other.json()["error"]["code"]) == (409, "task_conflict")
        again = start({"reward_mode": "terminal", "lineage": "support"}, "s1", "agent-a")
        assert again.status_code == 200 and again.json()["lineage"] == "support"

        # Rail samples train the default line: a key limited to `support` may not upload; an unlimited one is
        # forwarded (the fake child knows no rail route: its 404 shows the batch reached it).
        batch = {"session_id": "rail-1", "samples": []}
        rail = gw.signed("POST", "/v1/gateway/upload/batch", json=batch, agent="agent-a")
        assert (rail.status_code, rail.json()["error"]["code"]) == (403, "lineage_forbidden")
        rail = gw.signed("POST", "/v1/gateway/upload/batch", json=batch, agent="agent-b")
        assert (rail.status_code, rail.json()["error"]["code"]) == (404, "not_found")
        assert sum(c["path"] == "/v1/gateway/upload/batch" for c in child_calls(tmp_path)) == 1

        starts = [call for call in child_calls(tmp_path) if call["path"] == "/v1/rl/tasks/start"]
        starts = [s for s in starts if s["headers"]["x-agent-session-id"] != "s1" or s is starts[0]]
        assert [s["headers"]["x-aigw-rl-lineage"] for s in starts] == ["support", "default"]
        assert [s["headers"]["x-aigw-rl-policy-name"] for s in starts] == ["tiny:support:v1", "base"]
        assert json.loads(starts[0]["body"])["lineage"] == "support"  # forwarded as it came
        # The registration cap of agent-b's key travels with its starts only (docs/lineages.md "Lifecycle").
        assert [s["headers"].get("x-aigw-rl-max-lineages") for s in starts] == [None, "7"]

        # The internal retire route (the RL Service's archive / delete): the default line never, a line of
        # another model never; a line of this model serves nothing afterwards.
        for line, expected in (("tiny", (400, "invalid_lineage")), ("tiny:v2", (400, "invalid_lineage")),
                               ("other:support", (404, "model_not_found"))):
            r = internal(gw, tmp_path, "POST", "/loras/retire", {"line": line})
            assert (r.status_code, r.json()["error"]["code"]) == expected, line
        r = internal(gw, tmp_path, "POST", "/loras/retire", {"line": "tiny:support"})
        assert r.json() == {"status": "retired", "line": "tiny:support", "versions": ["tiny:support:v1"]}
        assert gw.signed("GET", "/v1/loras/tiny:support").json()["active_lora"] is None


def test_agent_key_lineage_limit_applies_to_stop_and_reward_and_reveals_no_other_keys_task(
        tmp_path, redis_url, vllm) -> None:
    def keys(agent_a_lineages: list[str]) -> dict:
        return {"apiHmacKey": API_KEY.decode(), "insHmacKey": INS_KEY.decode(),
                "agentHmacKeys": [{"id": "agent-a", "key": gw.agent_keys["agent-a"].hex(),
                                   "lineages": agent_a_lineages},
                                  {"id": "agent-b", "key": gw.agent_keys["agent-b"].hex()}]}

    def start(lineage: str, session: str, agent: str) -> str:
        r = gw.signed("POST", "/v1/rl/tasks/start", json={"reward_mode": "terminal", "lineage": lineage},
                      headers={"X-Agent-Session-Id": session}, agent=agent)
        assert r.status_code == 201, r.text
        return r.json()["rl_task_id"]

    def call(task: str, action: str, agent: str | None) -> httpx.Response:
        return gw.signed("POST", f"/v1/rl/tasks/{task}/{action}", json={"reward": 1.0} if action == "reward" else {},
                         agent=agent)

    gw = gateway(tmp_path, redis_url, vllm)
    write_key_file(gw.key_file, keys(["support", "coding"]))
    with gw:
        gw.start_service()
        support = start("support", "s1", "agent-a")
        coding_active = start("coding", "s2", "agent-a")
        coding_done = start("coding", "s3", "agent-a")
        other_key = start("coding", "s4", "agent-b")
        assert call(coding_done, "stop", "agent-a").status_code == 200  # inside the limit: allowed
        # The binding knows the lineage: a stop of another key's Task stays unknown, as before.
        assert call(other_key, "stop", "agent-a").json()["error"]["code"] == "task_not_found"

    # The operator narrows agent-a to `support`; the restarted gateway has no binding: it reads the RL record.
    gw = gateway(tmp_path, redis_url, vllm)
    write_key_file(gw.key_file, keys(["support"]))
    with gw:
        gw.start_service()
        mark = len(child_calls(tmp_path))
        for task, action in ((coding_active, "stop"), (coding_done, "reward"), (coding_active, "reward")):
            r = call(task, action, "agent-a")
            assert (r.status_code, r.json()["error"]["code"]) == (403, "lineage_forbidden"), (task, action, r.text)
        forwarded = [c["path"] for c in child_calls(tmp_path)[mark:] if c["method"] == "POST"]
        assert forwarded == []  # refused before reaching the RL Service
        # Another key's Task, and an unknown one, answer exactly as before: unknown (no 403 reveals them).
        for task in (other_key, "t" + "0" * 32):
            for action in ("stop", "reward"):
                r = call(task, action, "agent-a")
                assert (r.status_code, r.json()["error"]["code"]) == (404, "task_not_found"), (task, action)
        # Inside the limit, and for unlimited keys and the operator, nothing changes.
        assert call(support, "reward", "agent-a").status_code == 200
        assert call(support, "stop", "agent-a").status_code == 200
        assert call(other_key, "reward", "agent-b").status_code == 200
        assert call(coding_active, "stop", None).status_code == 200
