"""Every lineage name the grammar accepts works end to end (issue 37 item 6): `v1-x` passed `is_lineage`, but the
version parser found `v1` inside `tiny:v1-x:v1`, so the run trained and then failed at activation, wasting the
training slot. Hypothesis draws names from the grammar itself (common/lineage.py `LINEAGE_RE`, `is_lineage`) and
each goes start → capture → reward → train → activate → serve through the real gateway and its real RL Service child
(scripted trainer), a private Redis and a fake vLLM that records which adapter served each request."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from openjiuwen.agent_evolving.agent_rl.common.lineage import LINEAGE_RE, is_lineage, line_of, lora_name
from tests.support.fake_vllm import CHAT_PATH, FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.system.test_gateway_lora import wait_run

pytestmark = pytest.mark.system

NAMES = st.from_regex(LINEAGE_RE, fullmatch=True).filter(is_lineage)


def test_every_name_the_grammar_accepts_trains_activates_and_serves(tmp_path, redis_url) -> None:
    trained: Counter[str] = Counter()
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm, GatewayProcess(tmp_path, redis_url,
                                                                              instances=[vllm]) as gw:
        gw.start_service()

        def task(lineage: str, session: str) -> dict:
            r = gw.signed("POST", "/v1/rl/tasks/start", json={"reward_mode": "terminal", "lineage": lineage},
                          headers={"X-Agent-Session-Id": session})
            assert r.status_code == 201, r.text
            mark = len(vllm.requests)
            answer = gw.http.post(CHAT_PATH, headers={"X-Agent-Session-Id": session}, json={
                "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": lineage}]})
            assert answer.status_code == 200, answer.text
            served = [q.body["model"] for q in vllm.requests[mark:] if q.path == CHAT_PATH]
            return {**r.json(), "served": served}

        @settings(max_examples=8, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(lineage=NAMES)
        @example(lineage="v1-x")  # the name: `v1` inside the line
        @example(lineage="default")
        def one_name(lineage: str) -> None:
            line = line_of("tiny", lineage)
            before = lora_name(line, trained[lineage]) if trained[lineage] else "base"
            started = task(lineage, f"s-{lineage}-{trained[lineage]}-a")
            assert started["policy_lora_name"] == before
            rl_task_id = started["rl_task_id"]
            assert gw.signed("POST", f"/v1/rl/tasks/{rl_task_id}/stop").status_code == 200
            r = gw.signed("POST", f"/v1/rl/tasks/{rl_task_id}/reward", json={"reward": 1.0})
            assert r.json() == {"sample_count": 1}, r.text

            r = gw.signed("POST", "/v1/rl/training/runs", json={"lineage": lineage})
            assert r.status_code == 201, r.text
            run = wait_run(gw, r.json()["training_run_id"])
            trained[lineage] += 1
            expected = lora_name(line, trained[lineage])
            assert (run["status"], run["lora_name"]) == ("succeeded", expected), run
            assert gw.signed("GET", f"/v1/loras/{line}").json()["active_lora"]["lora_name"] == expected

            served = task(lineage, f"s-{lineage}-{trained[lineage]}-b")
            assert (served["policy_lora_name"], served["served"]) == (expected, [expected])
            assert gw.signed("POST", f"/v1/rl/tasks/{served['rl_task_id']}/stop").status_code == 200

        one_name()
    assert trained["v1-x"] >= 1 and sum(trained.values()) >= 3

