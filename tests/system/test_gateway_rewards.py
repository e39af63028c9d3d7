"""External rewards through the gateway (docs/rewards.md): HMAC-signed, proxied unchanged to the RL Service child."""

from __future__ import annotations

import openai
import pytest

from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess

pytestmark = pytest.mark.system

POLICY = {
    "aggregation": "last",
    "sources": {"human": {"deadline_seconds": 86400, "fallback": "skip"},
                "business": {"deadline_seconds": 3600, "fallback": "default", "default_score": 0.0}},
}


def test_signed_rewards_release_a_waiting_sample(redis, redis_url, tmp_path):
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm, GatewayProcess(
        tmp_path, redis_url, instances=[vllm], rl_overrides={"reward_policy": POLICY}
    ) as gw:
        gw.start_service()
        t = gw.start_task("s1").json()["rl_task_id"]
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_headers={"X-Agent-Session-Id": "s1"})
        gw.signed("POST", f"/v1/rl/tasks/{t}/stop")
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 0.9}).json() == {"sample_count": 1}
        (item,) = gw.signed("GET", "/v1/rl/trajectories", params={"status": "awaiting_rewards"}).json()["items"]
        sample = item["trajectory_id"]
        path = f"/v1/rl/trajectories/{sample}/rewards"
        # Unsigned: refused by the gateway, the sample is untouched.
        assert gw.http.post(path, json={"source": "human", "score": 0.1}).status_code == 401
        one = gw.signed("POST", path, json={"source": "human", "score": 0.1})
        assert (one.status_code, one.json()["status"]) == (200, "awaiting_rewards"), one.text
        conflict = gw.signed("POST", path, json={"source": "human", "score": 0.2})
        assert (conflict.status_code, conflict.json()["error"]["code"]) == (409, "reward_conflict")
        batch = gw.signed("POST", "/v1/rl/trajectories/rewards", json={"rewards": [
            {"trajectory_id": sample, "source": "business", "score": 0.5},
            {"trajectory_id": "unknown", "source": "business", "score": 0.5}]})
        assert [(r["ok"], r.get("status")) for r in batch.json()["results"]] == [(True, "pending"), (False, None)]
        detail = gw.signed("GET", f"/v1/rl/trajectories/{sample}").json()
        assert (detail["status"], detail["judge"]["score"]) == ("pending", 0.5)  # `last`: the business metric
        stats = gw.signed("GET", "/v1/rl/trajectories/stats").json()
        assert stats["by_status"]["pending"] == 1 and stats["rewards"]["sources"]["human"]["arrived"] == 1
