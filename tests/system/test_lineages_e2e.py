"""Lineages end to end (docs/lineages.md, issue 27 item 7): the real gateway process and its real RL Service child
(scripted trainer, `training_policy.auto`), a private Redis and a fake vLLM that records which adapter served each
request. Two lineages, `up` (every Task rewarded 1) and `down` (rewarded 0), are captured through the gateway, and
with NO operator call inside the loop each is trained on its own samples into its own version, activated on its own
line; new Tasks of each are pinned to and served by their own adapter, while a default-lineage Task in the same run
is unchanged. A second test restarts the gateway (and so its RL Service child) mid-loop: both lines keep their
active versions, no sample is lost, and training goes on to v2 of each."""

from __future__ import annotations

import time
from typing import Any

import openai
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.support.fake_vllm import CHAT_PATH, FakeVLLM
from tests.support.gateway_process import API_KEY, INS_KEY, GatewayProcess, write_key_file
from tests.support.invariants import check_invariants

pytestmark = pytest.mark.system

POLICY = {"auto": True, "min_pending_samples": 2, "poll_interval_seconds": 0.1}
REWARD = {"up": 1.0, "down": 0.0, "default": 0.5}


class Agents:
    """Agents of several lineages: each Task is one completion through the OpenAI SDK, stopped and rewarded."""

    def __init__(self, gw: GatewayProcess, vllm: FakeVLLM) -> None:
        self.gw, self.vllm = gw, vllm
        self.client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        self.n = 0
        self.tasks: dict[str, list[str]] = {}

    def task(self, lineage: str) -> dict[str, Any]:
        """Run one Task of `lineage` (`default`: no `lineage` in the start body); returns the start answer plus the
        model vLLM was asked for."""
        self.n += 1
        session = f"{lineage}-user-{self.n}"
        body: dict[str, Any] = {"reward_mode": "terminal"}
        if lineage != "default":
            body["lineage"] = lineage
        started = self.gw.signed("POST", "/v1/rl/tasks/start", json=body, headers={"X-Agent-Session-Id": session})
        assert started.status_code == 201, started.text
        task = started.json()
        mark = len(self.vllm.requests)
        self.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"q{self.n}"}], max_tokens=4,
            extra_headers={"X-Agent-Session-Id": session})
        served = [r.body["model"] for r in self.vllm.requests[mark:] if r.path == CHAT_PATH]
        rl_task_id = task["rl_task_id"]
        assert self.gw.signed("POST", f"/v1/rl/tasks/{rl_task_id}/stop").status_code == 200
        r = self.gw.signed("POST", f"/v1/rl/tasks/{rl_task_id}/reward", json={"reward": REWARD[lineage]})
        assert r.status_code == 200, r.text
        self.tasks.setdefault(lineage, []).append(rl_task_id)
        return {**task, "served": served}


def runs(gw: GatewayProcess) -> list[dict[str, Any]]:
    r = gw.signed("GET", "/v1/rl/training/runs")
    assert r.status_code == 200, r.text
    return r.json()["items"]


def wait_active(gw: GatewayProcess, line: str, lora_name: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The succeeded run that produced `lora_name`, once it is the line's active version on the gateway."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = [run for run in runs(gw) if run["lora_name"] == lora_name and run["status"] == "succeeded"]
        active = gw.signed("GET", f"/v1/loras/{line}").json().get("active_lora") if done else None
        if active is not None and active["lora_name"] == lora_name:
            return done[0]
        assert time.monotonic() < deadline, f"no automatic run produced {lora_name}: {runs(gw)}"
        time.sleep(0.1)


async def claimed_lineages(redis, run_id: str) -> set[str]:
    """The lineages of the samples the run claimed (its private batch), read from Redis."""
    run = orjson.loads(await redis.get(keys.training_run(run_id)))
    assert run["sample_ids"]
    return {((await redis.hget(keys.traj(s), "lineage")) or b"default").decode() for s in run["sample_ids"]}


def gateway(tmp_path, redis_url, vllm) -> GatewayProcess:
    gw = GatewayProcess(tmp_path, redis_url, instances=[vllm], rl_overrides={"training_policy": POLICY})
    write_key_file(gw.key_file, {  # agent-a may start Tasks of `up` only
        "apiHmacKey": API_KEY.decode(), "insHmacKey": INS_KEY.decode(),
        "agentHmacKeys": [{"id": "agent-a", "key": gw.agent_keys["agent-a"].hex(), "lineages": ["up"]},
                          {"id": "agent-b", "key": gw.agent_keys["agent-b"].hex()}]})
    return gw


async def test_two_lineages_with_opposite_rewards_train_and_serve_their_own_versions(redis, redis_url, tmp_path):
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm, gateway(tmp_path, redis_url, vllm) as gw:
        gw.start_service()
        agents = Agents(gw, vllm)
        # The loop: Tasks of both lineages and of the default one; no operator call until both versions exist.
        for _ in range(2):
            for lineage in ("up", "down"):
                assert agents.task(lineage)["policy_model"] == "tiny"  # both lines start from the base model
        up_run = wait_active(gw, "tiny:up", "tiny:up:v1")
        down_run = wait_active(gw, "tiny:down", "tiny:down:v1")
        for run, lineage in ((up_run, "up"), (down_run, "down")):
            assert (run["lineage"], run["trigger"]["kind"], run["trigger"]["lineage"]) == (lineage, "auto", lineage)
            assert run["sample_count"] == 2
            assert await claimed_lineages(redis, run["training_run_id"]) == {lineage}  # its own samples only
        assert gw.signed("GET", "/v1/loras/tiny").json()["status"] == "base"  # the default line untouched
        assert all(run["lineage"] in ("up", "down") for run in runs(gw)) and len(runs(gw)) == 2

        # New Tasks are pinned to their line's version, and every completion is served by that adapter.
        for lineage in ("up", "down", "up", "down"):
            task = agents.task(lineage)
            assert task["policy_model"] == f"tiny:{lineage}:v1"
            assert task["served"] == [f"tiny:{lineage}:v1"]
        default = agents.task("default")
        assert (default["policy_model"], default["served"]) == ("tiny", ["tiny"])
        record = gw.signed("GET", f"/v1/rl/tasks/{default['rl_task_id']}").json()
        assert "lineage" not in record  # the default lineage's records are what they were
        up_record = gw.signed("GET", f"/v1/rl/tasks/{agents.tasks['up'][-1]}").json()
        assert up_record["lineage"] == "up"

        # An agent key limited to `up` may start `up` Tasks, never `down` ones.
        start = {"reward_mode": "terminal", "lineage": "down"}
        refused = gw.signed("POST", "/v1/rl/tasks/start", json=start, headers={"X-Agent-Session-Id": "a-1"},
                            agent="agent-a")
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "lineage_forbidden")
        allowed = gw.signed("POST", "/v1/rl/tasks/start", json={**start, "lineage": "up"},
                            headers={"X-Agent-Session-Id": "a-2"}, agent="agent-a")
        assert allowed.status_code == 201, allowed.text
        assert gw.signed("POST", f"/v1/rl/tasks/{allowed.json()['rl_task_id']}/stop",
                         agent="agent-a").status_code == 200

        # The second round of each line trains again (2 pending each): v2, from its own v1.
        up2 = wait_active(gw, "tiny:up", "tiny:up:v2")
        down2 = wait_active(gw, "tiny:down", "tiny:down:v2")
        for run, lineage in ((up2, "up"), (down2, "down")):
            assert await claimed_lineages(redis, run["training_run_id"]) == {lineage}
            stored = orjson.loads(await redis.get(keys.training_run(run["training_run_id"])))
            assert stored["parent_lora_name"] == f"tiny:{lineage}:v1"  # from its own line's active version
        await check_invariants(redis, model_id="tiny")


async def test_a_gateway_restart_mid_loop_keeps_both_lines_and_loses_no_sample(redis, redis_url, tmp_path):
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm:
        with gateway(tmp_path, redis_url, vllm) as gw:
            gw.start_service()
            agents = Agents(gw, vllm)
            for lineage in ("up", "down", "up", "down"):
                agents.task(lineage)
            wait_active(gw, "tiny:up", "tiny:up:v1")
            wait_active(gw, "tiny:down", "tiny:down:v1")
            agents.task("up")  # one pending sample of each line when the gateway goes down
            agents.task("down")
        with gateway(tmp_path, redis_url, vllm) as gw:  # the gateway and its RL Service child restart
            gw.start_service()
            for lineage in ("up", "down"):
                status = gw.signed("GET", f"/v1/loras/tiny:{lineage}").json()
                assert status["active_lora"]["lora_name"] == f"tiny:{lineage}:v1"
            listed = {item["lineage"]: item for item in gw.signed("GET", "/v1/rl/lineages").json()["items"]}
            assert (listed["up"]["pending_samples"], listed["down"]["pending_samples"]) == (1, 1)
            agents = Agents(gw, vllm)
            for lineage in ("up", "down"):
                task = agents.task(lineage)  # the second sample of each: the scheduler trains both again
                assert (task["policy_model"], task["served"]) == (f"tiny:{lineage}:v1", [f"tiny:{lineage}:v1"])
            for lineage in ("up", "down"):
                run = wait_active(gw, f"tiny:{lineage}", f"tiny:{lineage}:v2")
                assert run["sample_count"] == 2  # the one published before the restart, and the new one
                assert await claimed_lineages(redis, run["training_run_id"]) == {lineage}
            await check_invariants(redis, model_id="tiny")
