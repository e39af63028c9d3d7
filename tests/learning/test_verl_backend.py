"""The verl backend on a local Ray, CPU only: verl's FSDP engine (gloo) runs real PPO steps on a tiny model.

One local Ray for the module (2 CPUs, no dashboard), shut down at the end. Each run starts fresh actor processes
(importing torch, transformers and verl: most of a run's time here).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.models.tiny import make_tiny_model
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
from openjiuwen.agent_evolving.agent_rl.online.training.backends import TrainingCanceled
from openjiuwen.agent_evolving.agent_rl.online.training.backends.verl import VerlBackend, actor_name
from openjiuwen.agent_evolving.agent_rl.online.training.verl.compose import compose_ppo_config, settings_from_config
from tests.support import learning as L
from tests.support.fake_gateway import FakeGateway
from tests.support.service_app import make_config, running_app

ray = pytest.importorskip("ray")

SAMPLES, LENGTH = 32, 12
PPO_YAML = """
actor_rollout_ref:
  actor:
    optim:
      lr: 2.0e-3
    ppo_epochs: 4
  rollout:
    log_prob_micro_batch_size_per_gpu: 16
data:
  max_prompt_length: 64
  max_response_length: 64
"""


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token file written under ~/.ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def make_backend(repository, tmp_path: Path, ppo_yaml: str = PPO_YAML, **kwargs) -> VerlBackend:
    (tmp_path / "ppo.yaml").write_text(ppo_yaml)
    tree = compose_ppo_config(advantage_estimator="reinforce_plus_plus", tis_cap=None,
                              ppo_config_path=str(tmp_path / "ppo.yaml"), env={})
    return VerlBackend(repository, model_id="tiny", ppo_config=tree,
                       settings=settings_from_config(tree, tis_cap=None, ppo_samples_per_step=0),
                       tmp_root=tmp_path / "train-tmp", progress_interval_s=0.2, **kwargs)


async def test_a_run_through_the_service_trains_publishes_and_learns(redis, redis_url, tmp_path, tiny_model,
                                                                     local_ray):
    base = L.load_model(tiny_model)
    prompt = L.prompt_ids(tiny_model)
    responses = L.sample_responses(base, prompt, SAMPLES, LENGTH, seed=0)
    logprobs = [L.sequence_logprobs(base, prompt, r) for r in responses]
    order = sorted(range(SAMPLES), key=lambda i: L.target_share(responses[i]))
    rewards = [1.0 if i in order[SAMPLES // 2:] else 0.0 for i in range(SAMPLES)]
    before = L.margin(base, prompt, responses, rewards)
    async with FakeGateway(model_id="tiny") as gateway:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted",
                             base_model_path=str(tiny_model), min_samples_for_training=SAMPLES,
                             max_samples_per_run=SAMPLES, training_tmp_root=str(tmp_path / "train-tmp"))
        from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository

        backend = make_backend(LoraRepository(config.lora_repository_path, model_id="tiny"), tmp_path)
        async with running_app(config, backend=backend) as (app, client):
            deps = app.state.deps
            docs = L.documents(prompt, responses, logprobs, rewards, "tiny")
            await deps.store.insert_if_absent([PackedSample.from_document(d) for d in docs])
            r = await client.post("/v1/rl/training/runs")
            assert r.status_code == 201, r.text
            run = await deps.runner.wait(r.json()["training_run_id"])
            assert run.status == "succeeded", run.failure_reason
            assert gateway.active == (run.lora_name, run.lora_path)
    adapter = Path(run.lora_path)
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "metadata.json"]
    after = L.margin(L.load_model(tiny_model, adapter), prompt, responses, rewards)
    print(f"verl margin before {before:.3f} after {after:.3f}")
    assert after - before > 0.4, (before, after)
    step = run.metrics["step_metrics"][0]
    assert run.metrics["steps"] == 1 and step["samples"] == SAMPLES and step["tokens"] == SAMPLES * LENGTH
    for key in ("loss", "kl", "clip_fraction", "grad_norm", "tokens_per_second"):
        assert key in step
    meta = __import__("json").loads((adapter / "metadata.json").read_text())
    assert (meta["trainer_backend"], meta["training_source"], meta["ppo_steps"]) == ("verl", "base_model", 1)
    assert list((tmp_path / "train-tmp").iterdir()) == []  # the actor's run directory is gone
    with pytest.raises(ValueError):
        ray.get_actor(actor_name("tiny"), namespace=backend.namespace)  # killed after the run
