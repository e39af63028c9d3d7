"""Automatic training end to end (docs/training.md): gateway + RL Service child (scripted trainer, `training_policy
.auto`) + private Redis + fake vLLM. Tasks are captured through the official `openai` SDK and rewarded; no operator
asks for a Training Run, yet one starts, a new version becomes active, and a pause through the gateway holds the
next one until it is resumed."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.support.invariants import check_invariants
from tests.system.test_rollout import Env

pytestmark = pytest.mark.system

POLICY = {"auto": True, "min_pending_samples": 2, "poll_interval_seconds": 0.1}
QUALITY = {"tiny": 0.5, "tiny:v1": 0.5, "tiny:v2": 0.5}


def runs(gw: GatewayProcess) -> list[dict[str, Any]]:
    r = gw.signed("GET", "/v1/rl/training/runs")
    assert r.status_code == 200, r.text
    return r.json()["items"]


def wait_for_version(gw: GatewayProcess, lora_name: str, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        done = [run for run in runs(gw) if run["lora_name"] == lora_name and run["status"] == "succeeded"]
        active = gw.signed("GET", "/v1/loras/tiny").json()["active_lora"] if done else None
        if active is not None and active["lora_name"] == lora_name:
            return done[0]
        assert time.monotonic() < deadline, f"no automatic run produced {lora_name}: {runs(gw)}"
        time.sleep(0.1)


async def test_captured_rewarded_tasks_train_by_themselves(redis, redis_url, tmp_path):
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm, GatewayProcess(
            tmp_path, redis_url, instances=[vllm], rl_overrides={"training_policy": POLICY}) as gw:
        gw.start_service()
        env = Env(gw, (vllm,), QUALITY)
        env.task()
        assert runs(gw) == []  # one sample: below min_pending_samples
        env.task()
        run = wait_for_version(gw, "tiny:v1")
        assert run["trigger"]["kind"] == "auto" and run["trigger"]["reason"] == "min_pending_samples"
        assert run["trigger"]["eligible_samples"] == 2 and run["sample_count"] == 2
        assert env.task() == "tiny:v1"  # the next Task is pinned to the new version

        paused = gw.signed("POST", "/v1/rl/lineages/default/pause")
        assert paused.status_code == 200 and paused.json()["paused"] is True, paused.text
        env.task()  # two pending now: eligible but for the pause
        time.sleep(1.0)  # ten scheduler ticks
        assert len(runs(gw)) == 1
        view = gw.signed("GET", "/v1/rl/lineages/default").json()
        assert (view["scheduler"]["pending_samples"], view["scheduler"]["reason"]) == (2, "paused")
        missing = gw.signed("GET", "/v1/rl/lineages/support")
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "lineage_not_found")

        assert gw.signed("POST", "/v1/rl/lineages/default/resume").status_code == 200
        second = wait_for_version(gw, "tiny:v2")
        assert second["trigger"]["kind"] == "auto"
        await check_invariants(redis, model_id="tiny", strict_active_index=True)
