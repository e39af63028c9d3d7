"""The whole gateway path with real processes: gateway + RL Service child + private Redis + fake vLLM instances,
agents through the official `openai` SDK (CONTRACT §3, §9 Gateway)."""

from __future__ import annotations

import openai
import pytest

from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess

pytestmark = pytest.mark.system


@pytest.fixture
def vllm():
    with FakeVLLM(served_model="tiny", name="vllm-a") as a, FakeVLLM(served_model="tiny", name="vllm-b") as b:
        yield a, b


def test_bypass_then_capture_reward_and_stream(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=list(vllm)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        # Before any Task: bypass, and private fields are hidden.
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4)
        assert out.choices[0].message.content
        extra = out.model_dump()
        assert "prompt_token_ids" not in extra and "token_ids" not in extra["choices"][0]
        assert all("return_token_ids" not in (r.body or {}) for v in vllm for r in v.requests)
        # While stopped, Task start is refused.
        r = gw.start_task("s1")
        assert (r.status_code, r.json()["error"]["code"]) == (503, "rl_service_unavailable")
        gw.start_service()
        assert (gw.dir / "rl-service.stderr.log").exists()  # the child's own output is kept beside the state
        r = gw.start_task("s1")
        assert r.status_code == 201, r.text
        task = r.json()
        t = task["rl_task_id"]
        assert task["policy_lora_name"] == "base" and task["policy_model"] == "tiny"
        headers = {"X-Agent-Session-Id": "s1"}
        out = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, extra_headers=headers)
        assert "token_ids" not in out.choices[0].model_dump() and out.choices[0].logprobs is None
        stream = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "again"}],
                                                max_tokens=5, stream=True, extra_headers=headers)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text
        # The upstream saw the pinned model and the injected flags.
        captured = [r.body for v in vllm for r in v.requests if (r.body or {}).get("return_token_ids")]
        assert len(captured) == 2 and all(b["model"] == "tiny" and b["logprobs"] is True for b in captured)
        stopped = gw.signed("POST", f"/v1/rl/tasks/{t}/stop")
        assert stopped.json()["status"] == "finalized"
        rewarded = gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0})
        assert rewarded.json() == {"sample_count": 2}, rewarded.text
        stats = gw.signed("GET", "/v1/rl/trajectories/stats").json()
        assert stats["by_status"]["pending"] == 2
        # Unsigned control is refused.
        assert gw.http.get("/v1/rl/trajectories/stats").status_code == 401


def test_operator_cli_sends_signed_requests(redis, redis_url, tmp_path, vllm):
    import subprocess
    import sys

    with GatewayProcess(tmp_path, redis_url, instances=list(vllm)) as gw:
        command = [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.cli.main", "call", "--url", gw.url,
                   "--key-file", str(gw.dir / "hmac.json")]
        out = subprocess.run(command + ["POST", "/v1/rl/service/start"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith("200 ") and '"running"' in out.stdout, out
        out = subprocess.run(command + ["POST", "/v1/rl/tasks/start", "--data", '{"reward_mode": "terminal"}',
                                        "-H", "X-Agent-Session-Id: cli-session"],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.startswith("201 "), out
        bad = subprocess.run([sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.cli.main", "call", "--url",
                              gw.url, "--key-file", str(tmp_path / "wrong.json"), "GET", "/v1/rl/service"],
                             capture_output=True, text=True, timeout=60, input="")
        assert bad.returncode != 0
