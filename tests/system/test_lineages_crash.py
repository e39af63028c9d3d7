"""Lineages under crashes (docs/lineages.md "Tests", issue 27 item 7): the real gateway process and its real RL
Service child as a worker group (`workers: 2`, scripted trainer, `training_policy.auto`, `rollout.mode: canary`), a
private Redis and a fake vLLM.

Two lineages: `up` ends with an active version and a live canary candidate (v1 promoted, v2 deciding); `down` with an
active version (v1) and an automatic run of its next two samples blocked in training. The leader worker is SIGKILLed
mid-run; a new leader settles the run; then the gateway (and so the RL Service) restarts. Nothing is lost: every
sample is stored once (invariant checker), each line keeps its active version and candidate at the gateway and in
the RL Service's rollout, the interrupted run is `failed` (`service_restarted`, as the worker group defines it), its
samples are pending on `down`'s own line, and the next automatic run of `down` trains exactly them.

A second test pins the default lineage's Task start as the gateway forwards it: the body byte for byte what the agent
sent, and `X-AIGW-RL-Lineage: default` the only header lineages added."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import RequestSigner
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.workers.lease import Holder
from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.support.invariants import check_invariants
from tests.support.waiting import wait_for
from tests.system.test_lineages_e2e import Agents, runs

pytestmark = pytest.mark.system

POLICY = {"auto": True, "min_pending_samples": 2, "poll_interval_seconds": 0.1}
# A canary that never decides by itself (min_tasks far above the Tasks here): the candidate stays until an operator.
ROLLOUT = {"mode": "canary", "min_tasks": 1000, "decision_interval_seconds": 0.5}
CHILD = Path(__file__).resolve().parents[1] / "support" / "fake_rl_child.py"


def gateway(tmp_path: Path, redis_url: str, vllm: FakeVLLM) -> GatewayProcess:
    return GatewayProcess(tmp_path, redis_url, instances=[vllm],
                          rl_overrides={"workers": 2, "training_policy": POLICY, "rollout": ROLLOUT})


def line_state(gw: GatewayProcess, lineage: str) -> dict[str, Any]:
    """The line's active version and candidate as the gateway and the RL Service's rollout report them."""
    lora = gw.signed("GET", f"/v1/loras/tiny:{lineage}")
    assert lora.status_code == 200, lora.text
    rollout = gw.signed("GET", "/v1/rl/rollout", params={"lineage": lineage})
    assert rollout.status_code == 200, rollout.text
    current = rollout.json()["current"]
    return {
        "active": (lora.json()["active_lora"] or {}).get("lora_name"),
        "candidate": (lora.json().get("candidate") or {}).get("lora_name"),
        "rollout": None if current is None else (current["rollout_id"], current["status"],
                                                 current["candidate"]["lora_name"]),
    }


def wait_candidate(gw: GatewayProcess, lineage: str, lora_name: str) -> None:
    # Both sides: the gateway holds the candidate before the RL Service's rollout record says so (a promote in
    # between is 409 no_rollout), and with concurrent runs the two lines' canaries start at once.
    def both() -> bool:
        state = line_state(gw, lineage)
        return state["candidate"] == lora_name and state["rollout"] is not None and state["rollout"][2] == lora_name

    wait_for(both, timeout_s=60.0, what=f"{lora_name} as the candidate of tiny:{lineage}")


def promote(gw: GatewayProcess, lineage: str, lora_name: str) -> None:
    r = gw.signed("POST", "/v1/rl/rollout/promote", json={"lineage": lineage})
    assert r.status_code == 200, r.text
    wait_for(lambda: line_state(gw, lineage) == {"active": lora_name, "candidate": None, "rollout": None},
             timeout_s=30.0, what=f"{lora_name} promoted")


async def leader_pid(redis) -> int | None:
    holder = Holder.parse(await redis.get(keys.LEADER))
    return None if holder is None else holder.pid


async def pending_ids(redis, line: str) -> set[str]:
    return {m.decode() for m in await redis.zrange(keys.traj_index(line, "pending"), 0, -1)}


def run_of(gw: GatewayProcess, run_id: str) -> dict[str, Any]:
    r = gw.signed("GET", f"/v1/rl/training/runs/{run_id}")
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_leader_sigkill_mid_run_and_a_gateway_restart_keep_every_line_and_lose_nothing(
        redis, redis_url, tmp_path):
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm:
        with gateway(tmp_path, redis_url, vllm) as gw:
            gw.start_service()
            agents = Agents(gw, vllm)
            for lineage in ("up", "down", "up", "down"):
                agents.task(lineage)
            for lineage in ("up", "down"):  # each line's v1 is its candidate against base; the operator promotes
                wait_candidate(gw, lineage, f"tiny:{lineage}:v1")
                promote(gw, lineage, f"tiny:{lineage}:v1")
            for _ in range(2):
                agents.task("up")
            wait_candidate(gw, "up", "tiny:up:v2")  # a live canary: v2 against the active v1

            gw.set_plan({"outcome": "block"})
            for _ in range(2):
                agents.task("down")
            blocked = wait_for(
                lambda: next((r for r in runs(gw) if r.get("lineage") == "down" and r["status"] == "running"
                              and r["stage"] == "training"), None),
                timeout_s=60.0, what="an automatic run of down in training")
            assert (blocked["trigger"]["kind"], blocked["trigger"]["lineage"]) == ("auto", "down")
            run_id = blocked["training_run_id"]
            claimed = set(orjson.loads(await redis.get(keys.training_run(run_id)))["sample_ids"])
            assert len(claimed) == 2
            # Paused, so that no automatic run starts on down before the checks below (the pause is in Redis).
            assert gw.signed("POST", "/v1/rl/lineages/down/pause").status_code == 200
            before = {lineage: line_state(gw, lineage) for lineage in ("up", "down")}
            assert before["up"]["active"] == "tiny:up:v1" and before["up"]["candidate"] == "tiny:up:v2"
            assert before["up"]["rollout"][1:] == ("running", "tiny:up:v2")
            assert before["down"] == {"active": "tiny:down:v1", "candidate": None, "rollout": None}

            old = await leader_pid(redis)
            assert old is not None
            os.kill(old, signal.SIGKILL)
            settled = wait_for(lambda: (r := run_of(gw, run_id))["status"] != "running" and r, timeout_s=30.0,
                               what="the interrupted run to be settled")
            assert (settled["status"], settled["failure_reason"]) == ("failed", "service_restarted")
            new = await leader_pid(redis)
            assert new is not None and new != old
            assert await pending_ids(redis, "tiny:down") == claimed  # back to pending of their own line
            assert {lineage: line_state(gw, lineage) for lineage in ("up", "down")} == before

        with gateway(tmp_path, redis_url, vllm) as gw:  # the gateway and its RL Service child restart
            gw.start_service()
            assert {lineage: line_state(gw, lineage) for lineage in ("up", "down")} == before
            assert run_of(gw, run_id)["status"] == "failed"
            assert await pending_ids(redis, "tiny:down") == claimed
            assert await pending_ids(redis, "tiny:up") == set()
            report = await check_invariants(redis, model_id="tiny", raise_on_violation=False)
            assert report.ok, report.violations
            assert report.samples == 8  # 4 up + 4 down Tasks, one completion each: every sample once

            # Resumed, the next automatic run of down trains exactly the interrupted run's samples.
            assert gw.signed("POST", "/v1/rl/lineages/down/resume").status_code == 200
            wait_candidate(gw, "down", "tiny:down:v2")
            retried = [r for r in runs(gw) if r["lora_name"] == "tiny:down:v2" and r["status"] == "succeeded"]
            assert len(retried) == 1 and retried[0]["trigger"]["kind"] == "auto"
            stored = orjson.loads(await redis.get(keys.training_run(retried[0]["training_run_id"])))
            assert set(stored["sample_ids"]) == claimed
            assert stored["parent_lora_name"] == "tiny:down:v1"
            assert line_state(gw, "up") == before["up"]  # up's canary untouched by down's rollout
            report = await check_invariants(redis, model_id="tiny", raise_on_violation=False)
            assert report.ok, report.violations


def test_the_default_lineages_task_start_is_forwarded_byte_for_byte(tmp_path, redis_url) -> None:
    """A default start (no `lineage` in the body) reaches the RL Service with the agent's body bytes unchanged and the
    headers of before lineages (Task id, policy name and model) plus `X-AIGW-RL-Lineage: default`, nothing else."""
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm:
        gw = GatewayProcess(tmp_path, redis_url, instances=[vllm],
                            online_overrides={"command": [sys.executable, str(CHILD)]})
        gw.env.update(FAKE_CHILD_PORT=str(gw.rl_port), FAKE_CHILD_OUT=str(tmp_path / "calls.jsonl"),
                      FAKE_CHILD_TOKEN=str(tmp_path / "token"))
        with gw:
            gw.start_service()
            # Odd spacing and an escape: a gateway that re-encoded the body would change these bytes.
            body = b'{"reward_mode":  "terminal" ,"metadata":{"k":"\\u00e9"}}'
            request = gw.http.build_request("POST", "/v1/rl/tasks/start", content=body, headers={
                "content-type": "application/json", "X-Agent-Session-Id": "s1"})
            r = gw.http.send(RequestSigner(gw.api_key).sign_httpx(request))
            assert r.status_code == 201, r.text
        calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
        starts = [c for c in calls if c["path"] == "/v1/rl/tasks/start"]
        assert len(starts) == 1
        assert starts[0]["body"].encode() == body
        headers = starts[0]["headers"]
        rl_headers = {k: v for k, v in headers.items() if k.startswith("x-aigw-rl-")}
        assert rl_headers == {"x-aigw-rl-task-id": r.json()["rl_task_id"], "x-aigw-rl-policy-name": "base",
                              "x-aigw-rl-policy-model": "tiny", "x-aigw-rl-lineage": "default"}
        assert headers["x-agent-session-id"] == "s1"
