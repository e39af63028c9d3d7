"""Training Runs survive a SIGKILL of the service (CONTRACT §4.7 Recover), with real processes: the service, a
private Redis and a fake gateway on real sockets."""

from __future__ import annotations


import httpx
import orjson
import pytest

from tests.conftest import load_fixture
from tests.support.fake_gateway import FakeGateway, Hang
from tests.support.invariants import check_invariants
from tests.support.service_process import ServiceProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.system

REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")


def publish_samples(url: str, count: int) -> None:
    with httpx.Client(base_url=url, timeout=10) as c:
        headers = {"X-Agent-Session-Id": "s-crash", "X-AIGW-RL-Task-Id": "tcrash",
                   "X-AIGW-RL-Policy-Name": "base", "X-AIGW-RL-Policy-Model": "tiny"}
        assert c.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"}, headers=headers).status_code == 201
        for i in range(count):
            hook = {"rl_task_id": "tcrash", "capture_id": f"cap{i}", "agent_turn_id": None}
            injected = c.post("/internal/v1/completions:before", json=dict(hook, request=REQUEST)).json()["request"]
            r = c.post("/internal/v1/completions:after", json=dict(hook, request=injected, response=RESPONSE))
            assert r.status_code == 204
        assert c.post("/v1/rl/tasks/tcrash/stop").status_code == 200
        assert c.post("/v1/rl/tasks/tcrash/reward", json={"reward": 1.0}).json() == {"sample_count": count}


def by_status(url: str) -> dict[str, int]:
    return httpx.get(url + "/v1/rl/trajectories/stats").json()["by_status"]


def service(tmp_path, redis_url, gateway, plan_path) -> ServiceProcess:
    return ServiceProcess(
        tmp_path, redis_url, env={"ONLINE_RL_SCRIPTED_PLAN": str(plan_path)}, aigw_endpoint=gateway.url,
        trainer_backend="scripted", min_samples_for_training=3, max_samples_per_run=3,
        lora_activation_timeout=60.0, training_tmp_root=str(tmp_path / "train-tmp"),
    )


async def test_kill_during_training_then_restart_restores_samples(redis, redis_url, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_bytes(orjson.dumps({"outcome": "block"}))
    async with FakeGateway(model_id="tiny") as gateway:
        svc = service(tmp_path, redis_url, gateway, plan)
        with svc.start():
            publish_samples(svc.url, 3)
            run_id = httpx.post(svc.url + "/v1/rl/training/runs").json()["training_run_id"]
            wait_for(lambda: httpx.get(f"{svc.url}/v1/rl/training/runs/{run_id}").json()["stage"] == "training",
                     what="stage training")
            assert by_status(svc.url)["training"] == 3
            svc.sigkill()
            svc.wait(10)
            svc.start()
            run = httpx.get(f"{svc.url}/v1/rl/training/runs/{run_id}").json()
            assert (run["status"], run["failure_reason"]) == ("failed", "service_restarted")
            assert by_status(svc.url) == {"pending": 3, "training": 0, "trained": 0, "failed": 0}
            assert gateway.activations == []
            # The restored samples train in the next run.
            plan.write_bytes(orjson.dumps({"outcome": "succeed"}))
            nxt = httpx.post(svc.url + "/v1/rl/training/runs")
            assert nxt.status_code == 201
            done = wait_for(lambda: (r := httpx.get(f"{svc.url}/v1/rl/training/runs/"
                                                    f"{nxt.json()['training_run_id']}").json())["status"]
                            == "succeeded" and r, what="second run")
            assert done["lora_name"] == "tiny:v1"


async def test_kill_during_activation_then_restart_retries_it(redis, redis_url, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_bytes(orjson.dumps({"outcome": "succeed"}))
    async with FakeGateway(model_id="tiny") as gateway:
        gateway.activate_plan.append(Hang(30.0, switch=False))
        svc = service(tmp_path, redis_url, gateway, plan)
        with svc.start():
            publish_samples(svc.url, 3)
            run_id = httpx.post(svc.url + "/v1/rl/training/runs").json()["training_run_id"]
            wait_for(lambda: gateway.activations, what="the activation call")
            assert httpx.get(f"{svc.url}/v1/rl/training/runs/{run_id}").json()["stage"] == "activating"
            svc.sigkill()
            svc.wait(10)
            svc.start()  # recovery retries the activation before serving
            run = httpx.get(f"{svc.url}/v1/rl/training/runs/{run_id}").json()
            assert (run["status"], run["stage"], run["lora_name"]) == ("succeeded", "activating", "tiny:v1")
            assert len(gateway.activations) == 2 and gateway.activations[0] == gateway.activations[1]
            assert gateway.active == (run["lora_name"], run["lora_path"])
            assert by_status(svc.url)["trained"] == 3


@pytest.mark.parametrize("point", ["rollout.intent", "rollout.switched"])
async def test_kill_during_a_promotion_then_restart_finishes_it(redis, redis_url, tmp_path, point):
    """docs/rollout.md: the intent is written before the gateway call, so a SIGKILL-equivalent exit on either side
    of that call is finished by the restart: the candidate is active, the record `promoted`, exactly once."""
    plan = tmp_path / "plan.json"
    plan.write_bytes(orjson.dumps({"outcome": "succeed"}))
    async with FakeGateway(model_id="tiny", canary=True) as gateway:
        svc = ServiceProcess(
            tmp_path, redis_url, env={"ONLINE_RL_SCRIPTED_PLAN": str(plan), "ONLINE_RL_CRASH_AT": point},
            aigw_endpoint=gateway.url, trainer_backend="scripted", min_samples_for_training=3,
            max_samples_per_run=3, lora_activation_timeout=10.0, training_tmp_root=str(tmp_path / "train-tmp"),
            rollout={"mode": "manual", "decision_interval_seconds": 0.2},
        )
        with svc.start():
            publish_samples(svc.url, 3)
            run_id = httpx.post(svc.url + "/v1/rl/training/runs").json()["training_run_id"]
            wait_for(lambda: httpx.get(f"{svc.url}/v1/rl/training/runs/{run_id}").json()["status"] == "succeeded",
                     what="the run")
            assert gateway.candidate is not None and gateway.candidate[0] == "tiny:v1"
            with pytest.raises(httpx.TransportError):
                httpx.post(svc.url + "/v1/rl/rollout/promote", timeout=10)
            assert svc.wait(10) == 86  # the crash point, not a clean exit
            svc.env.pop("ONLINE_RL_CRASH_AT")
            svc.start()  # recovery finishes the promotion before serving
            status = httpx.get(svc.url + "/v1/rl/rollout").json()
            assert status["current"] is None and status["recent"][0]["status"] == "promoted", status
            assert gateway.active == ("tiny:v1", gateway.active[1]) and gateway.candidate is None
            promotes = [a for a, _ in gateway.canary_calls if a == "promote"]
            assert len(promotes) == (1 if point == "rollout.intent" else 2)  # the repeat is idempotent
            active = orjson.loads((tmp_path / "loras" / "tiny" / "active").read_bytes())
            assert active["lora_name"] == "tiny:v1"
            await check_invariants(redis, model_id="tiny")
