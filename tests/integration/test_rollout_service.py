"""The RL Service's rollout against a gateway on a real socket (docs/rollout.md): a service configured for a canary
under a gateway without the canary routes refuses to start with a clear error; `immediate` never asks."""

from __future__ import annotations

import asyncio

import pytest

from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.rollout.controller import RolloutUnsupported
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from openjiuwen.agent_evolving.agent_rl.online.store.fence import UNFENCED
from tests.integration.test_training_runs import publish
from tests.support.fake_gateway import FakeGateway, Hang
from tests.support.service_app import MODEL_ID, make_config, running_app


@pytest.mark.parametrize("mode", ["canary", "manual"])
async def test_gated_mode_refuses_to_start_under_a_gateway_without_canary_routes(redis, redis_url, tmp_path, mode):
    async with FakeGateway(model_id=MODEL_ID) as gw:  # the AIGW routes only, as an older gateway
        config = make_config(redis_url, tmp_path, aigw_endpoint=gw.url, rollout={"mode": mode})
        with pytest.raises(RolloutUnsupported) as refused:
            async with running_app(config):
                pass
    message = str(refused.value)
    assert f"rollout.mode is {mode}" in message and "missing_canary_routes" in message


async def test_immediate_mode_starts_under_the_same_gateway(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID) as gw:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gw.url)
        async with running_app(config) as (_, client):
            status = (await client.get("/v1/rl/rollout")).json()
            assert (status["mode"], status["current"]) == ("immediate", None)
            nothing = await client.post("/v1/rl/rollout/promote")
            assert (nothing.status_code, nothing.json()["error"]["code"]) == (409, "no_rollout")
            bad = await client.post("/v1/rl/loras/activate", json={"lora_name": "other:v1"})
            assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_lora_name")
            missing = await client.post("/v1/rl/loras/activate", json={"lora_name": f"{MODEL_ID}:v3"})
            assert (missing.status_code, missing.json()["error"]["code"]) == (404, "lora_version_not_found")
            body = await client.post("/v1/rl/rollout/pause", json={"x": 1})
            assert (body.status_code, body.json()["error"]["code"]) == (400, "invalid_rollout_request")
            unknown = await client.get("/v1/rl/rollout/ro-zzz/events")
            assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "rollout_not_found")


async def test_a_stop_while_the_candidate_loads_leaves_no_candidate_without_a_rollout(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID, canary=True) as gw:
        gw.canary_plan.append(Hang(10.0, switch=True))  # loaded at the gateway, the answer still pending
        config = make_config(redis_url, tmp_path, aigw_endpoint=gw.url, trainer_backend="scripted",
                             min_samples_for_training=3, max_samples_per_run=3, lora_activation_timeout=20.0,
                             training_tmp_root=str(tmp_path / "train-tmp"), rollout={"mode": "canary"})
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            await publish(app.state.deps, 3)
            run_id = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
            while gw.candidate is None:
                await asyncio.sleep(0.02)
            stopped = (await client.post(f"/v1/rl/training/runs/{run_id}/stop")).json()
            assert stopped["status"] == "canceled", stopped
            assert [action for action, _ in gw.canary_calls] == ["start", "abort"]
            assert gw.candidate is None  # no orphan candidate: the next run may start its own canary
            assert (await client.get("/v1/rl/rollout")).json()["current"] is None


async def test_a_gateway_candidate_without_a_live_rollout_is_aborted_at_start(redis, redis_url, tmp_path):
    """Its record lost (Redis data gone), a candidate would block every later canary and activation: start-up drops
    it; one that a live rollout owns is kept."""
    async with FakeGateway(model_id=MODEL_ID, canary=True) as gw:
        gw.candidate = (f"{MODEL_ID}:v4", str(tmp_path / "loras" / MODEL_ID / "v4"))
        config = make_config(redis_url, tmp_path, aigw_endpoint=gw.url, rollout={"mode": "canary"})
        async with running_app(config):
            assert [(a, b["lora_name"]) for a, b in gw.canary_calls] == [("abort", f"{MODEL_ID}:v4")]
            assert gw.candidate is None


async def test_the_rollout_store_refuses_a_move_outside_the_table(redis):
    """A change that would move a stored rollout along no edge of its table raises and writes nothing."""
    from openjiuwen.agent_evolving.agent_rl.online.rollout.record import Rollout
    from openjiuwen.agent_evolving.agent_rl.online.rollout.store import RolloutStore, new_rollout_id
    from openjiuwen.agent_evolving.agent_rl.online.transitions import IllegalTransition

    store = RolloutStore(redis, fence=UNFENCED)
    rollout_id = new_rollout_id()
    record = Rollout(rollout_id=rollout_id, kind="canary", status="running", created_at="2026-12-01T00:00:00+00:00")
    await store.create(record, "canary_started", {})
    with pytest.raises(IllegalTransition):
        await store.update(rollout_id, lambda r: r.evolve(status="promoted"), "canary_promoted", {})
    assert (await store.get(rollout_id)).status == "running"
    assert (await store.current()).rollout_id == rollout_id  # still the live one
    paused = await store.update(rollout_id, lambda r: r.evolve(status="paused"), "paused", {})
    assert paused.status == "paused"
