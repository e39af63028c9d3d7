"""Constrained samples are trained by their policy, through the whole stack (issue 35 item 3): an agent asks for
structured output (`response_format` json_schema) inside Tasks through the real gateway, the samples are captured with
`sampling.constraints`, rewarded, and a Training Run of the real local backend (the tiny model) is asked for.

- `constrained_samples.grammar: correct`: the run claims every sample, trains each row with the correction (its
  record counts them: `metrics.sampling.constrained_samples`), and activates a new version whose LoRA is trained.
- `exclude`: the samples are stored, rewarded and counted as `excluded`; no run can claim them (409
  `insufficient_samples`), so no version is trained and the policy stays the base model: the model is unchanged.

Whether `correct` teaches the unconstrained policy the structure is measured on SmolLM2 by
bench/constrained_learning_bench.py (docs/learning.md, "Learning from constrained samples").
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model
from tests.support import agent_model
from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess

pytestmark = pytest.mark.system

RUN_TIMEOUT_S = 180.0
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": SCHEMA, "strict": True}}
CALLS = 2  # per Task; two Tasks with rewards 1 and 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.mark.parametrize("policy", ["correct", "exclude"])
def test_constrained_samples_are_trained_or_kept_out_by_policy(redis, redis_url, tmp_path, model_dir, policy):
    rl = {"trainer_backend": "local", "base_model_path": str(model_dir), "lora_activation_timeout": 60.0,
          "constrained_samples": {"grammar": policy}}
    online = {"hookTimeout": "30s", "controlTimeout": "120s"}
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm:
        vllm.responder = agent_model.answer
        with GatewayProcess(tmp_path, redis_url, instances=[vllm], rl_overrides=rl, online_overrides=online) as gw:
            gw.start_service()
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=60)
            for n, reward in enumerate((1.0, 0.0)):
                task = gw.start_task(f"structured-{n}").json()["rl_task_id"]
                for turn in range(CALLS):
                    out = client.chat.completions.create(
                        model="tiny", response_format=RESPONSE_FORMAT, extra_headers={"X-Agent-Session-Id":
                                                                                      f"structured-{n}"},
                        messages=[{"role": "user", "content": f"The weather in Paris, as JSON ({turn})"}])
                    assert out.choices[0].message.content.startswith("{")
                assert gw.signed("POST", f"/v1/rl/tasks/{task}/stop").json()["status"] == "finalized"
                rewarded = gw.signed("POST", f"/v1/rl/tasks/{task}/reward", json={"reward": reward})
                assert rewarded.json() == {"sample_count": CALLS}, rewarded.text

            stats = gw.signed("GET", "/v1/rl/trajectories/stats").json()["by_status"]
            items = gw.signed("GET", "/v1/rl/trajectories", params={"limit": 100}).json()["items"]
            assert len(items) == 2 * CALLS
            assert all(set(item["sampling"]["constraints"]) == {"json_schema"} for item in items)
            started = gw.signed("POST", "/v1/rl/training/runs")

            if policy == "exclude":
                assert stats.get("excluded") == 2 * CALLS and stats["pending"] == 0, stats
                assert all(item["status"] == "excluded" for item in items)
                assert all(item["exclusion"] == {"reason": "constraint", "kinds": ["json_schema"]} for item in items)
                assert (started.status_code, started.json()["error"]["code"]) == (409, "insufficient_samples")
                assert gw.signed("GET", "/v1/loras/tiny").json()["status"] == "base"
                assert not vllm.loaded and not (gw.lora_root / "tiny").exists()  # nothing trained, nothing loaded
                return

            assert stats["pending"] == 2 * CALLS, stats
            assert started.status_code == 201, started.text
            run_id = started.json()["training_run_id"]
            run = gw.wait_run(run_id, RUN_TIMEOUT_S)
            assert run["status"] == "succeeded", (run, gw.rl_log()[-3000:])
            assert run["sample_count"] == 2 * CALLS
            assert run["metrics"]["sampling"]["constrained_samples"] == 2 * CALLS
            assert gw.signed("GET", "/v1/loras/tiny").json()["active_lora"]["lora_name"] == "tiny:v1"
            assert "tiny:v1" in vllm.loaded
    weights = load_file(str(Path(run["lora_path"]) / "adapter_model.safetensors"))
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert lora_b and any(torch.count_nonzero(w) > 0 for w in lora_b)  # B starts at zero: the update moved it
