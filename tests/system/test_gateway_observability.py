"""Observability through the real gateway process (issue 9): unsigned `GET /metrics` with the `gw_*` series and the
RL Service's `rl_*` series federated, and the signed proxies of the listing, timeline and policy routes."""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess

pytestmark = pytest.mark.system


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def test_metrics_and_read_routes_through_the_gateway(redis, redis_url, tmp_path):
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm, \
            GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        before = gw.http.get("/metrics")
        assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain; version=0.0.4")
        m = parse(before.text)
        assert m[("gw_rl_service_up", frozenset())] == 0
        assert not any(name.startswith("rl_") for name, _ in m)  # no child yet: nothing federated
        gw.start_service()
        t = gw.start_task("s1").json()["rl_task_id"]
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_headers={"X-Agent-Session-Id": "s1"})
        m = parse(gw.http.get("/metrics").text)
        assert m[("gw_tasks_mapped", frozenset())] == 1
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 0.5}).json() == {"sample_count": 1}

        m = parse(gw.http.get("/metrics").text)
        assert m[("gw_rl_service_up", frozenset())] == 1
        assert m[("gw_tasks_mapped", frozenset())] == 0
        assert m[("gw_http_requests_total", frozenset({("route", "/v1/chat/completions"), ("status", "200")}))] == 1
        assert m[("gw_upstream_duration_seconds_count", frozenset({("instance", "vllm-a"), ("status", "200")}))] == 1
        assert m[("gw_capture_hook_duration_seconds_count", frozenset({("hook", "before")}))] == 1
        assert m[("gw_capture_hook_duration_seconds_count", frozenset({("hook", "after")}))] == 1
        assert m[("gw_lora_state", frozenset({("model", "tiny"), ("state", "base")}))] == 1
        assert m[("gw_lora_instance_ready", frozenset({("model", "tiny"), ("instance", "vllm-a")}))] == 1
        committed = frozenset({("model_id", "tiny"), ("result", "committed")})
        assert m[("rl_captures_total", committed)] == 1  # the child's series, federated
        assert m[("rl_trajectories", frozenset({("model_id", "tiny"), ("status", "pending")}))] == 1

        tasks = gw.signed("GET", "/v1/rl/tasks?status=finalized&limit=5").json()
        assert [x["rl_task_id"] for x in tasks["items"]] == [t] and tasks["next_cursor"] is None
        kinds = [e["type"] for e in gw.signed("GET", f"/v1/rl/tasks/{t}/events").json()["items"]]
        assert kinds == ["created", "capture_reserved", "capture_committed", "finalized", "reward_recorded"]
        assert gw.signed("GET", "/v1/rl/training/runs").json() == {"items": [], "next_cursor": None}
        policies = gw.signed("GET", "/v1/rl/policies").json()
        assert [(p["policy_version"], p["samples"], p["reward"]["mean"]) for p in policies["items"]] == [
            ("base", 1, 0.5)]
        bad = gw.signed("GET", "/v1/rl/tasks?limit=0")
        assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_request")
        assert gw.http.get("/v1/rl/policies").status_code == 401  # read routes stay signed
