"""Concurrent Training Runs under a leader SIGKILL (issue 36 item 1, docs/reliability.md): the real gateway process and
its real RL Service child as a worker group (`workers: 2`, scripted trainer, `training_policy.auto` with
`max_concurrent_runs: 3`), a private Redis and a fake vLLM.

Three lineages (`default`, `up`, `down`) each reach their threshold and get an automatic run; all three block in
training at once (the default one named by `training_run:active`, the others by `training_runs:active_lineages`).
The leader worker is SIGKILLed; the new leader settles every run (`failed`, `service_restarted`) and each batch goes
back to its own line's pending set (invariant checker: nothing lost, every claimed sample back, no pointer left).
Resumed, each line's next run trains exactly its own interrupted batch, once."""

from __future__ import annotations

import os
import signal

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.common.lineage import line_of
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.support.invariants import check_invariants
from tests.support.waiting import wait_for
from tests.system.test_lineages_crash import leader_pid, pending_ids, run_of
from tests.system.test_lineages_e2e import Agents, runs

pytestmark = pytest.mark.system

POLICY = {"auto": True, "min_pending_samples": 2, "poll_interval_seconds": 0.1, "max_concurrent_runs": 3}
LINEAGES = ("default", "up", "down")


def live_runs(gw: GatewayProcess) -> dict[str, dict]:
    return {r.get("lineage", "default"): r for r in runs(gw) if r["status"] == "running" and r["stage"] == "training"}


async def test_a_leader_sigkill_with_three_runs_live_returns_every_batch_to_its_own_line(redis, redis_url, tmp_path):
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm:
        gw = GatewayProcess(tmp_path, redis_url, instances=[vllm],
                            rl_overrides={"workers": 2, "training_policy": POLICY})
        with gw:
            gw.start_service()
            gw.set_plan({"outcome": "block"})
            agents = Agents(gw, vllm)
            for lineage in LINEAGES * 2:
                agents.task(lineage)
            blocked = wait_for(lambda: len(live := live_runs(gw)) == 3 and live, timeout_s=60.0,
                               what="three automatic runs blocked in training at once")
            assert {r["trigger"]["kind"] for r in blocked.values()} == {"auto"}
            claimed = {lineage: set(orjson.loads(await redis.get(keys.training_run(run["training_run_id"])))
                                    ["sample_ids"]) for lineage, run in blocked.items()}
            assert all(len(ids) == 2 for ids in claimed.values())
            assert await redis.get(keys.ACTIVE_RUN) == blocked["default"]["training_run_id"].encode()
            assert {k.decode() for k in await redis.hkeys(keys.ACTIVE_LINEAGE_RUNS)} == {"up", "down"}
            report = await check_invariants(redis, model_id="tiny", raise_on_violation=False, training_policy=POLICY)
            assert report.ok, report.violations
            for lineage in LINEAGES:  # paused (in Redis): no run starts again before the checks below
                assert gw.signed("POST", f"/v1/rl/lineages/{lineage}/pause").status_code == 200

            old = await leader_pid(redis)
            assert old is not None
            os.kill(old, signal.SIGKILL)
            for lineage, run in blocked.items():
                settled = wait_for(lambda: (r := run_of(gw, run["training_run_id"]))["status"] != "running" and r,
                                   timeout_s=30.0, what=f"the interrupted run of {lineage} to be settled")
                assert (settled["status"], settled["failure_reason"]) == ("failed", "service_restarted")
            new = await leader_pid(redis)
            assert new is not None and new != old
            for lineage in LINEAGES:  # each batch back on its own line's pending set
                assert await pending_ids(redis, line_of("tiny", lineage)) == claimed[lineage]
            assert await redis.get(keys.ACTIVE_RUN) is None and await redis.hlen(keys.ACTIVE_LINEAGE_RUNS) == 0
            report = await check_invariants(redis, model_id="tiny", raise_on_violation=False, training_policy=POLICY)
            assert report.ok, report.violations
            assert report.samples == 6 and report.samples_by_status["pending"] == 6  # nothing lost

            gw.set_plan({"outcome": "succeed"})
            for lineage in LINEAGES:
                assert gw.signed("POST", f"/v1/rl/lineages/{lineage}/resume").status_code == 200
            done = wait_for(lambda: len(ok := {r.get("lineage", "default"): r for r in runs(gw)
                                               if r["status"] == "succeeded"}) == 3 and ok,
                            timeout_s=60.0, what="each line's next run to succeed")
            for lineage, run in done.items():  # exactly the interrupted batch, trained once
                stored = orjson.loads(await redis.get(keys.training_run(run["training_run_id"])))
                assert set(stored["sample_ids"]) == claimed[lineage]
            report = await check_invariants(redis, model_id="tiny", raise_on_violation=False, training_policy=POLICY)
            assert report.ok, report.violations
            assert report.samples_by_status["trained"] == 6
