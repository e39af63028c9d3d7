"""Learning test on a real pretrained model (issue 15, item 6): one Training Run through the service and the real
local backend makes SmolLM2-135M-Instruct prefer the completions a rule rewarded.

Setup: the converted SmolLM2 (session fixture `smollm2_dir`, tests/learning/conftest.py); SAMPLES completions of
LENGTH tokens sampled from it at the test's temperature (1, and 0.7 as an agent tuned lower sends it: issue 29) with
their true logprobs at that temperature, stored in the captured sample shape with the sampling record a capture
writes, so the trainer trains each row at it; reward
1 for the half richest in even token ids, 0 for the rest (a rule the model knows nothing about, so only training can
move it). Measure: mean per-token logprob (at the sampling temperature) of the rewarded completions minus that of
the unrewarded ones, under the base model and under the new adapter.

Measured on the 2-core development machine (lr 5e-4, 2 PPO epochs, LoRA r16 on all linear layers, fp32): seeds 0, 1,
2 raise the margin by 2.20, 1.80 and 1.85 nats per token (from 1.11, 1.12, 0.42). With the labels shuffled instead
(same completions, same run) it moves by -0.55, -0.70 and -0.49: that is the noise the 1.0 threshold stands clear
of. lr 1e-3 with 4 epochs raised it by 4.0 with a clip fraction of 0.61 — more than a test needs. At temperature 0.7
(margins at 0.7): seeds 0, 1, 2 raise it by 1.63, 1.97 and 1.48 (from -0.20, 0.25, -0.12); shuffled labels that
agree with the rule's on chance level (8, 6 of 16) move it by -0.12, +0.23 and, seed 1 (a shuffle agreeing on 8),
+0.10; seed 1's own shuffle, which happened to keep 12 of the 16 labels, moved it by 1.43, as mostly-right labels
should. Each case takes 25-60 s (the Training Run about 15-25 s of it) on a quiet machine, after the session
fixture's one-off ~35 s conversion.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.common.sampling import Sampling
from openjiuwen.agent_evolving.agent_rl.model_makers import smollm2
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
from tests.support import learning as L
from tests.support.fake_gateway import FakeGateway
from tests.support.service_app import make_config, running_app
from tests.support.runs import wait_for_run

MODEL_ID = "smollm2"
SAMPLES, LENGTH = 16, 8
PPO_YAML = """
actor_rollout_ref:
  actor:
    optim:
      lr: 5.0e-4
    ppo_epochs: 2
    ppo_mini_batch_size: 8
    ppo_micro_batch_size_per_gpu: 8
data:
  max_prompt_length: 64
  max_response_length: 16
"""
SEED = 0
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def chat_prompt(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))


def rule_rewards(responses: list[list[int]]) -> list[float]:
    order = sorted(range(len(responses)), key=lambda i: L.target_share(responses[i]))
    rewards = [0.0] * len(responses)
    for i in order[len(responses) // 2:]:
        rewards[i] = 1.0
    return rewards


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_one_run_raises_the_rewarded_margin_of_smollm2(redis, redis_url, tmp_path, smollm2_dir, temperature):
    base = L.load_model(smollm2_dir)
    prompt = chat_prompt(smollm2_dir)
    responses = L.sample_responses_cached(base, prompt, SAMPLES, LENGTH, seed=SEED, temperature=temperature)
    logprobs = L.batch_logprobs(base, prompt, responses, temperature)
    rewards = rule_rewards(responses)
    before = L.batch_margin(base, prompt, responses, rewards, temperature)
    del base

    (tmp_path / "ppo.yaml").write_text(PPO_YAML)
    async with FakeGateway(model_id=MODEL_ID) as gateway:
        config = make_config(
            redis_url, tmp_path, model_id=MODEL_ID, aigw_endpoint=gateway.url, trainer_backend="local",
            base_model_path=str(smollm2_dir), ppo_config_path=str(tmp_path / "ppo.yaml"),
            min_samples_for_training=SAMPLES, max_samples_per_run=SAMPLES,
            training_tmp_root=str(tmp_path / "train-tmp"),
        )
        async with running_app(config) as (app, client):
            deps = app.state.deps
            sampling = Sampling.of_request({"temperature": temperature}).record()
            docs = L.documents(prompt, responses, logprobs, rewards, MODEL_ID, sampling)
            await deps.samples.publisher.insert_if_absent([PackedSample.from_document(d) for d in docs])
            r = await client.post("/v1/rl/training/runs")
            assert r.status_code == 201, r.text
            run = await wait_for_run(deps.runner, r.json()["training_run_id"])
            assert run.status == "succeeded", run.failure_reason
            assert gateway.active == (run.lora_name, run.lora_path)

    step = run.metrics["step_metrics"][0]
    assert step["samples"] == SAMPLES and step["tokens"] == SAMPLES * LENGTH
    # Trained at the samples' own temperature: the parent reproduces the captured logprobs.
    report = run.metrics["sampling"]
    assert report["temperatures"] == {f"{temperature:g}": SAMPLES} and report["logprob_mismatch_max"] < 1e-4
    after = L.batch_margin(L.load_model(smollm2_dir, Path(run.lora_path)), prompt, responses, rewards, temperature)
    assert after - before > 1.0, (before, after)


def test_the_provisioned_directory_is_the_pinned_wheel_and_still_verifies(smollm2_dir):
    """The cached copy the learning tests use: converted from the installed, pinned GGUF (same SHA-256), and it
    passes the same verification as at conversion (config, tokenizer, a forward pass continuing to " Paris")."""
    marker = smollm2.read_marker(smollm2_dir)
    assert marker is not None and marker["source"]["version"] == smollm2.DISTRIBUTION_VERSION
    assert marker["source"]["sha256"] == smollm2.file_sha256(smollm2.find_gguf())
    checked = smollm2.verify(smollm2_dir)
    assert checked["probe"] == "The capital of France is Paris" and checked["parameters"] == 134_515_008
