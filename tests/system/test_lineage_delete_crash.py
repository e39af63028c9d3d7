"""A lineage's deletion survives a crash of the leader (docs/lineages.md "Lifecycle", docs/reliability.md): the real
service process, a private Redis and a fake gateway on real sockets. The service is stopped abruptly (`os._exit`, a
SIGKILL at that line) right after the n-th batch of a deletion; what it left is consistent (invariant checker: each
batch is whole) and marked, and the restarted leader finishes the deletion on its own. The other lineage is untouched.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online import lineage_purge
from openjiuwen.agent_evolving.agent_rl.online.faults import CRASH_AT_ENV, CRASH_EXIT_CODE
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.conftest import load_fixture
from tests.support.fake_gateway import FakeGateway
from tests.support.invariants import check_invariants
from tests.support.service_process import ServiceProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.system

REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")
TASKS = lineage_purge.BATCH + 10  # two batches of Tasks


def tasks_of(c: httpx.Client, lineage: str, count: int) -> None:
    """`count` Tasks of `lineage`, one completion each, stopped and rewarded (their samples pending)."""
    for i in range(count):
        t = f"t{lineage}{i}"
        headers = {"X-Agent-Session-Id": f"s{t}", "X-AIGW-RL-Task-Id": t, "X-AIGW-RL-Policy-Name": "base",
                   "X-AIGW-RL-Policy-Model": "tiny", "X-AIGW-RL-Lineage": lineage}
        assert c.post("/v1/rl/tasks/start", json={"reward_mode": "terminal", "lineage": lineage},
                      headers=headers).status_code == 201
        hook = {"rl_task_id": t, "capture_id": f"c{t}", "agent_turn_id": None}
        injected = c.post("/internal/v1/completions:before", json=dict(hook, request=REQUEST)).json()["request"]
        assert c.post("/internal/v1/completions:after", json=dict(hook, request=injected,
                                                                   response=RESPONSE)).status_code == 204
        assert c.post(f"/v1/rl/tasks/{t}/stop").status_code == 200
        assert c.post(f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0}).status_code == 200


def trained(c: httpx.Client, lineage: str) -> None:
    run_id = c.post("/v1/rl/training/runs", json={"lineage": lineage}).json()["training_run_id"]
    wait_for(lambda: c.get(f"/v1/rl/training/runs/{run_id}").json()["status"] == "succeeded", timeout_s=30,
             what=f"a run of {lineage}")


async def lineage_keys(redis, lineage: str, line: str) -> list[str]:
    """Keys named after the lineage or its line (its Tasks' and samples' ids carry its name here)."""
    names = [raw.decode() async for raw in redis.scan_iter(match="*", count=1000)]
    return sorted(k for k in names if line in k or f":{lineage}:" in k or k.endswith(f":{lineage}")
                  or f"t{lineage}" in k)


@pytest.mark.parametrize("hit", [1, 3], ids=["between-task-batches", "after-the-runs"])
async def test_a_leader_killed_mid_deletion_leaves_it_whole_and_the_next_one_finishes_it(redis, redis_url, tmp_path,
                                                                                          hit):
    plan = tmp_path / "plan.json"
    plan.write_bytes(orjson.dumps({"outcome": "succeed"}))
    async with FakeGateway(model_id="tiny") as gateway:
        svc = ServiceProcess(
            tmp_path, redis_url, env={"ONLINE_RL_SCRIPTED_PLAN": str(plan), CRASH_AT_ENV: f"lineage.purge_batch@{hit}"},
            aigw_endpoint=gateway.url, trainer_backend="scripted", min_samples_for_training=2, max_samples_per_run=2,
            lora_activation_timeout=10.0, training_tmp_root=str(tmp_path / "train-tmp"),
        )
        with svc.start(), httpx.Client(base_url=svc.url, timeout=30) as c:
            tasks_of(c, "gone", TASKS)
            trained(c, "gone")
            tasks_of(c, "kept", 3)
            trained(c, "kept")
            kept_before = c.get("/v1/rl/trajectories/stats", params={"lineage": "kept"}).json()["by_status"]
            kept_keys = await lineage_keys(redis, "kept", "tiny:kept")
            assert c.post("/v1/rl/lineages/gone/delete").status_code == 202
            assert svc.wait(30) == CRASH_EXIT_CODE  # the crash point, not a clean exit

            # Half deleted, and whole: every batch applied entirely or not at all, the deletion marked.
            await check_invariants(redis, model_id="tiny")
            assert orjson.loads(await redis.get(keys.lineage_state("gone")))["state"] == "deleting"
            assert await redis.zrange(keys.LINEAGES_RETIRING, 0, -1) == [b"gone"]
            left = await redis.zcard(keys.tasks_by_lineage("gone"))
            assert left == (TASKS - lineage_purge.BATCH if hit == 1 else 0)

            svc.env.pop(CRASH_AT_ENV)
            svc.start()  # the new leader finishes the deletion by itself
            wait_for(lambda: c.get("/v1/rl/lineages/gone").status_code == 404, timeout_s=30, what="the deletion")
            await check_invariants(redis, model_id="tiny")
            assert await lineage_keys(redis, "gone", "tiny:gone") == []
            assert await redis.zrange(keys.LINEAGES, 0, -1) == [b"kept"]
            assert await redis.zcard(keys.LINEAGES_RETIRING) == 0
            assert c.get("/v1/rl/trajectories/stats", params={"lineage": "kept"}).json()["by_status"] == kept_before
            assert await lineage_keys(redis, "kept", "tiny:kept") == kept_keys
            assert "tiny:gone" in gateway.retired and "tiny:kept" in gateway.line_active
