"""The warm multi-tenant local trainer (issue 36 item 2, docs/training.md "Warm trainer"): the real trainer process
(training/warm_worker.py) on a tiny random Qwen2 model, through its backend (backends/warm_local.py).

- two lineages' runs in flight together train in shared steps (one backward per micro-batch) and give each adapter
  exactly the weights it gets trained alone, and those of today's per-run worker: B's rows never reach A's adapter;
- a SIGKILL of the trainer with two runs live fails both, gives each batch back to its own line's pending set and
  publishes nothing; the next runs start a new trainer and train exactly those batches, once;
- a cancel of one run drops it before its next step; the other run of its group trains on, exactly as alone, in the
  same trainer process.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
from openjiuwen.agent_evolving.agent_rl.online.training.backends import TrainingCanceled, TrainingJob
from openjiuwen.agent_evolving.agent_rl.online.training.backends.local import LocalBackend
from openjiuwen.agent_evolving.agent_rl.online.training.backends.warm_local import WarmLocalBackend
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings
from openjiuwen.agent_evolving.agent_rl.online.assembly import make_backend
from tests.support import learning as L
from tests.support.fake_gateway import FakeGateway
from tests.support.invariants import check_invariants
from tests.support.runs import wait_for_run
from tests.support.service_app import MODEL_ID, make_config, running_app

LENGTH = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def batches(tiny) -> dict[str, list[dict]]:
    """Lineage a: 8 samples, b: 12 (their runs have 2 and 3 PPO steps of 4), drawn from the tiny model itself."""
    base = L.load_model(tiny)
    prompt = L.prompt_ids(tiny)
    out = {}
    for name, seed, count in (("a", 1, 8), ("b", 2, 12)):
        responses = L.sample_responses(base, prompt, count, LENGTH, seed)
        logprobs = [L.sequence_logprobs(base, prompt, r) for r in responses]
        docs = L.documents(prompt, responses, logprobs, [float(i % 2) for i in range(count)], MODEL_ID)
        out[name] = [dict(d, sample_id=f"{name}-{d['sample_id']}", trajectory_id=f"{name}-{d['trajectory_id']}",
                          lineage=name) for d in docs]
    return out


def settings(**changes) -> PPOSettings:
    return PPOSettings.from_dict({**PPOSettings().to_dict(), "learning_rate": 2e-3, "ppo_epochs": 2,
                                  "ppo_samples_per_step": 4, **changes})


def job(tiny: Path, run_id: str, lineage: str, samples: list[dict]) -> TrainingJob:
    return TrainingJob(training_run_id=run_id, model_id=MODEL_ID, base_model_path=str(tiny), samples=samples,
                       init_lora_name="base", init_lora_path="", line=f"{MODEL_ID}:{lineage}")


def weights(artifact) -> dict[str, torch.Tensor]:
    return load_file(str(Path(artifact.lora_path) / "adapter_model.safetensors"))


def assert_same(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> None:
    assert x.keys() == y.keys() and len(x) > 0
    for name in x:
        torch.testing.assert_close(x[name], y[name], rtol=1e-5, atol=1e-6, msg=name)


async def nothing(_metrics) -> None:
    return None


async def test_two_lineages_trained_together_get_the_weights_each_gets_alone(tiny, batches, tmp_path):
    repo = LoraRepository(tmp_path / "loras", model_id=MODEL_ID)
    warm = WarmLocalBackend(repo, settings=settings(), tmp_root=tmp_path / "train", gather_s=1.0)
    per_run = LocalBackend(repo, settings=settings(), tmp_root=tmp_path / "train")
    try:
        alone = {name: await warm.train(job(tiny, f"run-{name}-alone", name, batches[name]), on_progress=nothing)
                 for name in "ab"}
        together = dict(zip("ab", await asyncio.gather(*(
            warm.train(job(tiny, f"run-{name}-together", name, batches[name]), on_progress=nothing) for name in "ab"))))
        today = await per_run.train(job(tiny, "run-a-per-run", "a", batches["a"]), on_progress=nothing)
        assert warm.trainer_starts == 1  # one process, the base model loaded once, for all four runs
    finally:
        await warm.close()
    # They did share steps: a's two steps each ran with b's rows in the same backward, b's third step alone.
    assert [s["trained_with"] for s in together["a"].metadata["ppo_step_metrics"]] == [2, 2]
    assert [s.get("trained_with", 1) for s in together["b"].metadata["ppo_step_metrics"]] == [2, 2, 1]
    for name in "ab":
        assert_same(weights(together[name]), weights(alone[name]))
        assert together[name].metadata["sample_count"] == len(batches[name])
    assert_same(weights(alone["a"]), weights(today))  # the warm trainer trains as today's per-run worker does
    # The adapters did train, and differently: equal weights above are not two untouched initializations.
    a, b = weights(together["a"]), weights(together["b"])
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert any(float(a[k].abs().max()) > 0 for k in a if "lora_B" in k)


async def test_a_cancel_drops_one_run_and_the_other_trains_on_in_the_same_process(tiny, batches, tmp_path):
    repo = LoraRepository(tmp_path / "loras", model_id=MODEL_ID)
    slow = settings(ppo_samples_per_step=2, ppo_epochs=4)
    warm = WarmLocalBackend(repo, settings=slow, tmp_root=tmp_path / "train", gather_s=1.0)
    try:
        b_alone = await warm.train(job(tiny, "run-b-alone", "b", batches["b"]), on_progress=nothing)
        pid = warm.trainer_pid
        a_stepped = asyncio.Event()

        async def a_progress(_metrics) -> None:
            a_stepped.set()

        a_task = asyncio.create_task(warm.train(job(tiny, "run-a", "a", batches["a"]), on_progress=a_progress))
        b_steps: list[dict] = []

        async def b_progress(metrics) -> None:
            b_steps.append(metrics)

        b_task = asyncio.create_task(warm.train(job(tiny, "run-b", "b", batches["b"]), on_progress=b_progress))
        await asyncio.wait_for(a_stepped.wait(), 120)
        assert await warm.cancel("run-a") is True
        with pytest.raises(TrainingCanceled):
            await a_task
        b_together = await b_task
        assert warm.trainer_pid == pid and warm.trainer_starts == 1  # the process was not killed
    finally:
        await warm.close()
    assert len(b_steps) == 6 and b_steps[0]["trained_with"] == 2  # b started in a's group, went on without it
    assert any(s.get("trained_with", 1) == 1 for s in b_steps)
    assert_same(weights(b_together), weights(b_alone))
    assert not (tmp_path / "loras" / MODEL_ID / "lineages" / "a").exists() or not any(
        (tmp_path / "loras" / MODEL_ID / "lineages" / "a").glob("v*"))  # nothing of a was published


PPO_SLOW = """
actor_rollout_ref:
  actor:
    optim:
      lr: 2.0e-3
    ppo_epochs: 8
data:
  max_prompt_length: 64
  max_response_length: 64
"""


async def pending(redis, lineage: str) -> set[str]:
    line = f"{MODEL_ID}:{lineage}"
    return {m.decode() for m in await redis.zrange(keys.traj_index(line, "pending"), 0, -1)}


async def test_a_sigkilled_trainer_fails_its_runs_gives_the_batches_back_and_is_started_again(
        tiny, batches, redis, redis_url, tmp_path):
    (tmp_path / "ppo.yaml").write_text(PPO_SLOW)
    async with FakeGateway(model_id=MODEL_ID) as gateway:
        config = make_config(
            redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="local", base_model_path=str(tiny),
            ppo_config_path=str(tmp_path / "ppo.yaml"), min_samples_for_training=8, max_samples_per_run=12,
            training_tmp_root=str(tmp_path / "train-tmp"), ppo_samples_per_step=2,
            training_policy={"max_concurrent_runs": 2}, local={"warm_trainer": True, "gather_seconds": 0.5},
        )
        repo = LoraRepository(config.lora_repository_path, model_id=MODEL_ID)
        backend = make_backend(config, repo)
        assert isinstance(backend, WarmLocalBackend)
        async with running_app(config, backend=backend) as (app, client):
            deps = app.state.deps
            await redis.zadd(keys.LINEAGES, {"a": 1.0, "b": 2.0})
            for name in "ab":
                await deps.samples.publisher.insert_if_absent([PackedSample.from_document(d) for d in batches[name]])
            ids = {name: {d["sample_id"] for d in batches[name]} for name in "ab"}
            runs = {}
            for name in "ab":
                r = await client.post("/v1/rl/training/runs", json={"lineage": name})
                assert r.status_code == 201, r.text
                runs[name] = r.json()["training_run_id"]
            # Both runs are in the trainer's hands (each has reported a step) when it is killed.
            for _ in range(1200):
                got = [(await client.get(f"/v1/rl/training/runs/{runs[n]}")).json() for n in "ab"]
                if all(g.get("metrics", {}).get("steps", 0) >= 1 for g in got):
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"the runs never reported a step: {got}")
            first_pid = backend.trainer_pid
            assert first_pid is not None
            os.kill(first_pid, signal.SIGKILL)
            for name in "ab":
                run = await wait_for_run(deps.runner, runs[name])
                assert run.status == "failed" and "warm trainer exited with code -9" in run.failure_reason
                assert await pending(redis, name) == ids[name]  # the whole batch is pending again
            assert not any(Path(config.lora_repository_path).rglob("adapter_model.safetensors"))  # nothing published
            report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False,
                                            training_policy={"max_concurrent_runs": 2})
            assert [v for v in report.violations if "which has no record" not in v] == []
            # The next runs start a new trainer and train exactly those batches, once each.
            again = {}
            for name in "ab":
                r = await client.post("/v1/rl/training/runs", json={"lineage": name})
                assert r.status_code == 201, r.text
                again[name] = r.json()["training_run_id"]
            for name in "ab":
                run = await wait_for_run(deps.runner, again[name])
                assert run.status == "succeeded", run.failure_reason
                assert set(run.sample_ids) == ids[name]
                assert await pending(redis, name) == set()
            assert backend.trainer_starts == 2 and backend.trainer_pid not in (None, first_pid)
