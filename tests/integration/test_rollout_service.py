"""The RL Service's rollout against a gateway on a real socket (docs/rollout.md): a service configured for a canary
under a gateway without the canary routes refuses to start with a clear error; `immediate` never asks."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.online.rollout.controller import RolloutUnsupported
from tests.support.fake_gateway import FakeGateway
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
