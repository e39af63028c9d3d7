"""The verl backend on a local Ray, CPU only: verl's FSDP engine (gloo) runs real PPO steps on a tiny model.

One local Ray for the module (2 CPUs, no dashboard), shut down at the end. Each run starts fresh actor processes
(importing torch, transformers and verl: most of a run's time here).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import ray

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model
from openjiuwen.agent_evolving.agent_rl.online.training.backends import PLACEMENT, TrainingCanceled, TrainingJob
from openjiuwen.agent_evolving.agent_rl.online.training.backends.verl import VerlBackend, actor_name, ray_namespace
from openjiuwen.agent_evolving.agent_rl.online.training.verl.compose import compose_ppo_config, settings_from_config
from tests.support import learning as L
from tests.support.runs import wait_for_run


SAMPLES, LENGTH = 32, 12  # bench/gpu/verl_run.py's "cpu" size
PPO_YAML = "data: {max_prompt_length: 64, max_response_length: 64}\n"


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")  # Ray 2.60 would write a token file under ~/.ray otherwise
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _temp_dir=str(tmp_path_factory.mktemp("ray")))
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def make_backend(repository, tmp_path: Path, ppo_yaml: str = PPO_YAML, model_id: str = "tiny",
                 **kwargs) -> VerlBackend:
    (tmp_path / "ppo.yaml").write_text(ppo_yaml)
    tree = compose_ppo_config(advantage_estimator="reinforce_plus_plus", tis_cap=None,
                              ppo_config_path=str(tmp_path / "ppo.yaml"), env={})
    # A placement that never comes fails the test within minutes instead of stalling the suite.
    kwargs.setdefault("placement_timeout_s", PLACEMENT_TIMEOUT_S)
    return VerlBackend(repository, model_id=model_id, ppo_config=tree,
                       settings=settings_from_config(tree, tis_cap=None, ppo_samples_per_step=0),
                       tmp_root=tmp_path / "train-tmp", progress_interval_s=0.2, **kwargs)


PLACEMENT_TIMEOUT_S = 180.0


def wait_for_free_cpus(count: float, timeout_s: float = 120.0) -> None:
    """Ray frees a killed actor's CPU and a removed group's bundles asynchronously: a test that needs the whole
    local cluster waits for the previous test's to be given back (a CI run once found one still held)."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < count and time.monotonic() < deadline:
        time.sleep(0.5)


async def test_a_run_through_the_service_trains_publishes_and_learns(redis, redis_url, tmp_path, local_ray):
    """bench/gpu/verl_run.py CPU-sized: the GPU check's very code path, here with the tiny model. Same scenario as
    the local backend's learning test (32 × 12 tokens, lr 2e-3, 4 epochs): measured margin 0.002 → 0.884."""
    from bench.gpu import verl_run

    lines: list[str] = []
    result = await verl_run.run("cpu", tmp_path, redis_url=redis_url, device="cpu", log=lines.append)
    assert result["status"] == "succeeded" and result["activated"]
    assert result["margin_gain"] > 0.4, result
    assert any(line.startswith("learning margin") for line in lines) and any("tokens/s" in line for line in lines)
    adapter = Path(result["lora_path"])
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "metadata.json"]
    step = result["step_metrics"][0]
    assert len(result["step_metrics"]) == 1 and step["samples"] == SAMPLES and step["tokens"] == SAMPLES * LENGTH
    for key in ("loss", "kl", "clip_fraction", "grad_norm", "tokens_per_second"):
        assert key in step
    meta = json.loads((adapter / "metadata.json").read_text())
    assert (meta["trainer_backend"], meta["training_source"], meta["ppo_steps"]) == ("verl", "base_model", 1)
    assert meta["ray"]["namespace"] == ray_namespace("tiny")
    assert meta["ray"]["actor"] == actor_name("tiny", result["training_run_id"])
    assert meta["ray"]["bundle"] == {"CPU": 1.0} and meta["ray"]["waited_seconds"] >= 0
    assert result["leftover_tmp"] == []  # the actor's run directory is gone
    assert named_actors() == []  # killed after the run


async def test_the_gpu_check_trains_two_lineages_at_once(redis, redis_url, tmp_path, local_ray):
    """bench/gpu/verl_run.py `--lineages 2`, CPU-sized: two lineages' runs at once on the same samples with opposite
    reward rules; each learns its own rule (a cross-talk between the adapters would cancel the gains) and activates
    its own line's version."""
    from bench.gpu import verl_run

    lines: list[str] = []
    result = await verl_run.run("cpu", tmp_path, redis_url=redis_url, device="cpu", log=lines.append, lineages=2)
    runs = {r["lineage"]: r for r in result["runs"]}
    assert sorted(runs) == ["l0", "l1"] and result["leftover_tmp"] == []
    for name, r in runs.items():
        assert (r["status"], r["lora_name"], r["activated"]) == ("succeeded", f"tiny:{name}:v1", True), r
        assert r["margin_gain"] > 0.4, r  # alone: 0.002 -> 0.884 (the test above)
    assert runs["l0"]["margin_before"] == pytest.approx(-runs["l1"]["margin_before"])  # opposite rules
    assert any("concurrent runs: total wall" in line for line in lines)
    assert result["total_wall_seconds"] < result["sum_run_wall_seconds"]  # they overlapped


async def test_a_run_on_smollm2_trains_publishes_and_learns(redis, redis_url, tmp_path, local_ray, smollm2_dir):
    """The same path with the real pretrained SmolLM2-135M-Instruct (bench/gpu/verl_run.py `--model smollm2`, CPU
    size: 16 × 8 tokens, lr 5e-4, 2 epochs — the local backend's SmolLM2 scenario). Measured here: margin 1.110 →
    3.311 (+2.20) in a 51 s Training Run."""
    from bench.gpu import verl_run

    lines: list[str] = []
    result = await verl_run.run("cpu", tmp_path, model_name="smollm2", redis_url=redis_url, device="cpu",
                                log=lines.append)
    assert result["status"] == "succeeded" and result["activated"], result
    assert result["parameters"] == 134_515_008 and result["model_id"] == "smollm2"
    assert result["lora_name"] == "smollm2:v1"
    step = result["step_metrics"][0]
    assert step["samples"] == 16 and step["tokens"] == 16 * 8
    meta = json.loads((Path(result["lora_path"]) / "metadata.json").read_text())
    assert (meta["trainer_backend"], meta["ppo_steps"]) == ("verl", 1)
    assert result["margin_gain"] > 1.0, result  # shuffled labels move it by -0.5 to -0.7 (test_smollm2_learns.py)
    assert result["leftover_tmp"] == []


def few_samples(tiny_model: Path, count: int = 4) -> list[dict]:
    prompt = L.prompt_ids(tiny_model)
    responses = [[10 + i, 20 + i, 30 + i] for i in range(count)]
    return L.documents(prompt, responses, [[-1.0, -1.5, -2.0]] * count, [float(i % 2) for i in range(count)], "tiny")


async def _noop(_: dict) -> None:
    return None


def steps_of(seen: list[dict]) -> list[dict]:
    """The PPO steps among what `on_progress` got (the rest: the run's placement notes)."""
    return [m for m in seen if PLACEMENT not in m]


def named_actors(model_id: str = "tiny") -> list[str]:
    return sorted(e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                  if e["namespace"] == ray_namespace(model_id))


async def _wait_for_own_actor(backend: VerlBackend, run_id: str) -> None:
    for _ in range(600):  # the run's actors exist once `_start_actors` returned
        run = backend._runs.get(run_id)
        if run is not None and run.actors:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the run's actors never started")


async def test_cancel_kills_the_actor_and_a_leftover_of_the_model_is_swept(tmp_path, tiny_model, local_ray):
    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
    from openjiuwen.agent_evolving.agent_rl.online.training.verl.actor import PPORunner

    repository = LoraRepository(str(tmp_path / "loras"), model_id="tiny")
    backend = make_backend(repository, tmp_path)
    # What a crashed service leaves behind: a detached actor of one of its runs (it may hold a GPU), and one named
    # as before runs were concurrent (the bare prefix).
    leftovers = [ray.remote(PPORunner).options(
        name=name, namespace=backend.namespace, lifetime="detached", num_cpus=0,
    ).remote(rank=0, world_size=1, tmp_root=str(tmp_path / "train-tmp"))
        for name in (actor_name("tiny", "run-crashed"), actor_name("tiny", "run-crashed").rsplit("-run-", 1)[0])]
    for leftover in leftovers:
        await asyncio.wrap_future(leftover.progress.remote(0).future())
    task = asyncio.create_task(backend.train(TrainingJob(
        training_run_id="run-cancel", model_id="tiny", base_model_path=str(tiny_model),
        samples=few_samples(tiny_model), init_lora_name="base", init_lora_path=""), on_progress=_noop))
    await _wait_for_own_actor(backend, "run-cancel")
    assert named_actors() == [actor_name("tiny", "run-cancel")]  # the leftovers were swept before it was placed
    assert await backend.cancel("run-cancel") is True
    with pytest.raises(TrainingCanceled):
        await task
    assert named_actors() == []
    backend.check_health()  # a cancel is not a failure
    assert await backend.cancel("run-cancel") is False  # nothing left to stop
    assert not (tmp_path / "loras" / "tiny").exists() or list((tmp_path / "loras" / "tiny").iterdir()) == []


async def test_canceling_the_train_call_while_actors_start_leaves_no_actor(tmp_path, tiny_model, local_ray):
    """The runner cancels the execution task when `cancel` found no actor yet: nothing may outlive it."""
    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository

    backend = make_backend(LoraRepository(str(tmp_path / "loras"), model_id="tiny"), tmp_path)
    task = asyncio.create_task(backend.train(TrainingJob(
        training_run_id="run-early", model_id="tiny", base_model_path=str(tiny_model),
        samples=few_samples(tiny_model), init_lora_name="base", init_lora_path=""), on_progress=_noop))
    await asyncio.sleep(0.05)  # the starter thread is under way (it may or may not have created the actor yet)
    await backend.cancel("run-early")
    task.cancel()
    with pytest.raises((asyncio.CancelledError, TrainingCanceled)):
        await task
    assert named_actors() == []


async def test_an_actor_dying_on_its_own_fails_the_run_and_the_health(tmp_path, tiny_model, local_ray):
    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository

    backend = make_backend(LoraRepository(str(tmp_path / "loras"), model_id="tiny"), tmp_path)
    task = asyncio.create_task(backend.train(TrainingJob(
        training_run_id="run-dies", model_id="tiny", base_model_path=str(tiny_model),
        samples=few_samples(tiny_model), init_lora_name="base", init_lora_path=""), on_progress=_noop))
    await _wait_for_own_actor(backend, "run-dies")
    ray.kill(ray.get_actor(actor_name("tiny", "run-dies"), namespace=backend.namespace))  # e.g. the OOM killer
    with pytest.raises(RuntimeError, match="verl trainer actor died"):
        await task
    with pytest.raises(RuntimeError, match="actor died"):
        backend.check_health()


async def test_a_run_starts_from_the_parent_adapter_and_steps_by_ppo_samples_per_step(tmp_path, tiny_model,
                                                                                      local_ray):
    """With lr 0 the exported adapter must equal the parent exactly: proof that training started from it (a fresh
    LoRA has random A matrices). 5 samples, 3 per step → steps of 3 and 2, each reported through on_progress."""
    import safetensors.torch as st
    from peft import LoraConfig, get_peft_model

    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository

    parent = tmp_path / "parent"
    peft_model = get_peft_model(L.load_model(tiny_model), LoraConfig(
        r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM"))
    peft_model.save_pretrained(parent)
    (tmp_path / "ppo.yaml").write_text("actor_rollout_ref: {actor: {optim: {lr: 0.0}}}\n")
    tree = compose_ppo_config(advantage_estimator="reinforce_plus_plus", tis_cap=None,
                              ppo_config_path=str(tmp_path / "ppo.yaml"), env={})
    backend = VerlBackend(LoraRepository(str(tmp_path / "loras"), model_id="tiny"), model_id="tiny",
                          ppo_config=tree, settings=settings_from_config(tree, tis_cap=None, ppo_samples_per_step=3),
                          tmp_root=tmp_path / "train-tmp", progress_interval_s=0.2)
    seen: list[dict] = []

    async def on_progress(metrics: dict) -> None:
        seen.append(metrics)

    artifact = await backend.train(TrainingJob(
        training_run_id="run-parent", model_id="tiny", base_model_path=str(tiny_model),
        samples=few_samples(tiny_model, 5), init_lora_name="tiny:v7", init_lora_path=str(parent)),
        on_progress=on_progress)
    assert [(m["step"], m["samples"]) for m in steps_of(seen)] == [(1, 3), (2, 2)]
    assert [m[PLACEMENT]["state"] for m in seen if PLACEMENT in m] == ["placed"]  # nothing else ran: no wait
    assert (artifact.metadata["training_source"], artifact.metadata["parent_lora_id"]) == ("active_lora", "tiny:v7")
    assert artifact.metadata["ppo_steps"] == 2 and artifact.metadata["ppo_samples_per_step"] == 3
    # Bypass mode: the ratio's "old" side is the captured logprobs, so the first step's ppo_kl (mean of old − new
    # over its tokens) equals captured − parent logprobs, computed here independently.
    parent_model = L.load_model(tiny_model, parent)
    docs = few_samples(tiny_model, 5)[:3]
    gaps = [c - p for d in docs
            for c, p in zip(d["trajectory"]["response_logprobs"],
                            L.sequence_logprobs(parent_model, d["trajectory"]["prompt_ids"],
                                                d["trajectory"]["response_ids"]))]
    assert steps_of(seen)[0]["ppo_kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-3)
    before = st.load_file(parent / "adapter_model.safetensors")
    after = st.load_file(Path(artifact.lora_path) / "adapter_model.safetensors")
    assert sorted(before) == sorted(after)
    for key in before:
        assert (before[key] == after[key]).all(), key


async def test_tis_cap_trains_against_pi_old_of_the_parent(tmp_path, tiny_model, local_ray):
    """Decoupled mode: π_old is computed with the parent weights before the update, so the single mini-batch of
    the step sees a ratio of exactly 1 (ppo_kl 0), whatever the captured logprobs were."""
    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository

    tree = compose_ppo_config(advantage_estimator="reinforce_plus_plus", tis_cap=2.0, ppo_config_path=None, env={})
    backend = VerlBackend(LoraRepository(str(tmp_path / "loras"), model_id="tiny"), model_id="tiny",
                          ppo_config=tree, settings=settings_from_config(tree, tis_cap=2.0, ppo_samples_per_step=0),
                          tmp_root=tmp_path / "train-tmp")
    artifact = await backend.train(TrainingJob(
        training_run_id="run-tis", model_id="tiny", base_model_path=str(tiny_model),
        samples=few_samples(tiny_model, 4), init_lora_name="base", init_lora_path=""), on_progress=_noop)
    step = artifact.metadata["ppo_step_metrics"][0]
    assert step["samples"] == 4 and step["ppo_kl"] == pytest.approx(0.0, abs=1e-5)
    assert step["clip_fraction"] == 0.0


async def frozen_run(tmp_path, tiny_model, run_id: str, rows: list[tuple[float, dict, float, float]]):
    """A run at learning rate 0 over one sample per row (temperature, sampling record, logprob shift, reward): a
    fixed response with the base model's logprobs at that temperature, plus the shift (a constraint's doing)."""
    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository

    prompt = L.prompt_ids(tiny_model)
    base = L.load_model(tiny_model)
    docs = []
    for i, (temperature, sampling, shift, reward) in enumerate(rows):
        response = [10 + i, 200 + i, 30 + i, 90 + i]
        lps = [lp + shift for lp in L.sequence_logprobs(base, prompt, response, temperature)]
        [doc] = L.documents(prompt, [response], [lps], [reward], "tiny", sampling=sampling)
        docs.append(dict(doc, sample_id=f"{run_id}-{i}", trajectory_id=f"{run_id}-{i}", rl_task_id=f"t{i}"))
    backend = make_backend(LoraRepository(str(tmp_path / "loras"), model_id="tiny"), tmp_path,
                           "actor_rollout_ref: {actor: {optim: {lr: 0.0}}}\n")
    return await backend.train(TrainingJob(
        training_run_id=run_id, model_id="tiny", base_model_path=str(tiny_model), samples=docs,
        init_lora_name="base", init_lora_path=""), on_progress=_noop)


async def test_each_row_is_trained_at_its_samples_temperature(tmp_path, tiny_model, local_ray):
    """Issue 29: one batch mixing temperatures 0.7 and 1.3, each sample's captured logprobs the base model's own at
    its temperature (as vLLM reports them). verl's engine divides each row's logits by its row's temperature, so the
    run's sampling report finds no gap, and bypass mode's first ppo_kl (captured − recomputed) is 0; at temperature
    1 for every row the gap would be ~0.5 nats per token."""
    artifact = await frozen_run(tmp_path, tiny_model, "run-temps", [
        (temperature, {"temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0}, 0.0, float(i % 2))
        for i, temperature in enumerate((0.7, 1.3, 0.7, 1.3))])
    report = artifact.metadata["sampling"]
    assert report["temperatures"] == {"0.7": 2, "1.3": 2} and report["truncated_samples"] == 0
    assert report["tokens"] == 16 and report["logprob_mismatch_max"] < 1e-4, report
    assert report["ratio_clipped_share"] == 0.0
    assert artifact.metadata["ppo_step_metrics"][0]["ppo_kl"] == pytest.approx(0.0, abs=1e-4)


async def test_constrained_rows_are_trained_against_pi_old_in_a_bypass_run(tmp_path, tiny_model, local_ray):
    """Issue 35: in a bypass-mode run (no `tis_cap`), rows whose sampling was constrained are decoupled: their old
    logprobs are π_old of the parent and each token is weighted min(π_old / μ, 2). Here the constrained rows' captured
    logprobs sit 1 nat above the policy's (as a grammar's mask raises them): bypass mode would start their ratio at
    e^-1 (ppo_kl 0.5 over the batch), decoupled the first ratio is exactly 1 (ppo_kl 0), and verl's vanilla loss
    takes the run's own weights."""
    schema = {"temperature": 1.0, "constraints": {"json_schema": {"digest": "ab", "bytes": 9}}}
    artifact = await frozen_run(tmp_path, tiny_model, "run-constrained", [
        (1.0, schema if i % 2 == 0 else {"temperature": 1.0, "constraints": {}}, 1.0 if i % 2 == 0 else 0.0,
         float(i // 2)) for i in range(4)])
    report = artifact.metadata["sampling"]
    assert (report["correction"], report["constrained_samples"]) == ("ppo_clip+constrained_tis", 2), report
    assert report["untruncated_mismatch_max"] < 1e-4  # the unconstrained rows are exact
    assert artifact.metadata["constraints"] == {"json_schema": 2}
    assert artifact.metadata["ppo_step_metrics"][0]["ppo_kl"] == pytest.approx(0.0, abs=1e-4)


async def test_two_ranks_shard_the_batch_and_export_one_adapter(tmp_path, tiny_model, local_ray):
    """nproc_per_node 2 on CPU: two actors, a gloo process group with the rendezvous at rank 0, FSDP2 sharding the
    model over both, 5 samples (mini-batches of 4 and 1: the second is padded for rank 1), one adapter from rank 0."""
    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository

    wait_for_free_cpus(2)
    backend = make_backend(LoraRepository(str(tmp_path / "loras"), model_id="tiny"), tmp_path, nproc_per_node=2)
    seen: list[dict] = []

    async def on_progress(metrics: dict) -> None:
        seen.append(metrics)

    artifact = await backend.train(TrainingJob(
        training_run_id="run-two", model_id="tiny", base_model_path=str(tiny_model),
        samples=few_samples(tiny_model, 5), init_lora_name="base", init_lora_path=""), on_progress=on_progress)
    assert [(m["step"], m["samples"]) for m in steps_of(seen)] == [(1, 5)]
    assert sorted(p.name for p in Path(artifact.lora_path).iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "metadata.json"]
    assert artifact.metadata["ray"]["nproc"] == 2
    assert named_actors() == []  # both ranks


async def test_stop_through_the_service_kills_the_actor_and_restores_the_samples(redis, redis_url, tmp_path,
                                                                                  tiny_model, local_ray):
    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
    from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
    from tests.support.fake_gateway import FakeGateway
    from tests.support.service_app import make_config, running_app

    async with FakeGateway(model_id="tiny") as gateway:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted",
                             base_model_path=str(tiny_model), min_samples_for_training=4, max_samples_per_run=4)
        backend = make_backend(LoraRepository(config.lora_repository_path, model_id="tiny"), tmp_path)
        async with running_app(config, backend=backend) as (app, client):
            deps = app.state.deps
            await deps.samples.publisher.insert_if_absent(
                [PackedSample.from_document(d) for d in few_samples(tiny_model)])
            run_id = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
            await _wait_for_own_actor(backend, run_id)
            stopped = await client.post(f"/v1/rl/training/runs/{run_id}/stop")
            assert (stopped.json()["status"], stopped.json()["stage"]) == ("canceled", "training")
            stats = (await client.get("/v1/rl/trajectories/stats")).json()
    assert stats["by_status"]["pending"] == 4 and stats["by_status"].get("training", 0) == 0, stats
    assert named_actors() == []
    assert gateway.activations == []


async def _record(client, run_id: str) -> dict:
    return (await client.get(f"/v1/rl/training/runs/{run_id}")).json()


async def _until(check, what: str, timeout_s: float = 120.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (value := await check()) is None:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)
    return value


async def test_concurrent_runs_wait_for_resources_and_a_stop_or_a_death_ends_only_its_own_run(
        redis, redis_url, tmp_path, tiny_model, local_ray):
    """Issue 36 item 1 on verl, through the service: `max_concurrent_runs` 3 on a Ray of 2 CPUs, one CPU per run.
    Lineages a and b train at once (both actors alive together); c's resources are taken, so it waits and its record
    says so. a is stopped while b trains: only a's actor dies, a's batch is back on a's line. c is then placed; its
    actor dies (as to an OOM kill): c fails and its batch is back on c's line. b finishes and activates its own line's
    version. (Two lineages both training to their own activated versions at once, each learning its own rule: the
    GPU check's two-lineage test above.)"""
    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
    from openjiuwen.agent_evolving.agent_rl.online.store import keys
    from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
    from tests.support.fake_gateway import FakeGateway
    from tests.support.service_app import make_config, running_app

    async with FakeGateway(model_id="tiny") as gateway:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted",
                             base_model_path=str(tiny_model), min_samples_for_training=4, max_samples_per_run=4,
                             training_policy={"max_concurrent_runs": 3})
        backend = make_backend(LoraRepository(config.lora_repository_path, model_id="tiny"), tmp_path)
        async with running_app(config, backend=backend) as (app, client):
            deps = app.state.deps
            await deps.redis.zadd(keys.LINEAGES, {"a": 0, "b": 1, "c": 2})
            batches: dict[str, list[str]] = {}
            for name in "abc":
                docs = [dict(d, sample_id=f"{name}-{i}", trajectory_id=f"{name}-{i}", rl_task_id=f"{name}{i}",
                             lineage=name) for i, d in enumerate(few_samples(tiny_model))]
                await deps.samples.publisher.insert_if_absent([PackedSample.from_document(d) for d in docs])
                batches[name] = [d["sample_id"] for d in docs]

            async def start(name: str) -> str:
                answer = await client.post("/v1/rl/training/runs", json={"lineage": name})
                assert answer.status_code == 201, answer.text
                return answer.json()["training_run_id"]

            async def pending(name: str) -> set[str]:
                return {m.decode() for m in await deps.redis.zrange(keys.traj_index(f"tiny:{name}", "pending"), 0, -1)}

            runs = {name: await start(name) for name in "ab"}
            both = sorted(actor_name("tiny", runs[n]) for n in "ab")

            async def both_alive():
                return True if named_actors() == both else None

            await _until(both_alive, "a's and b's actors alive together")
            runs["c"] = await start("c")

            async def c_waiting():
                placement = (await _record(client, runs["c"]))["metrics"].get(PLACEMENT) or {}
                return placement if placement.get("state") == "waiting" else None

            waiting = await _until(c_waiting, "c's record to show it waits")
            assert (waiting["waiting_for"], waiting["bundle"]) == ("Ray resources", {"CPU": 1.0})
            stopped = (await client.post(f"/v1/rl/training/runs/{runs['a']}/stop")).json()
            assert stopped["status"] == "canceled"
            assert actor_name("tiny", runs["a"]) not in named_actors()
            assert actor_name("tiny", runs["b"]) in named_actors()  # b's run goes on
            assert (await _record(client, runs["b"]))["status"] == "running"
            assert await pending("a") == set(batches["a"])
            await _wait_for_own_actor(backend, runs["c"])  # placed once a's CPU came back
            ray.kill(ray.get_actor(actor_name("tiny", runs["c"]), namespace=backend.namespace))
            failed_c = await wait_for_run(deps.runner, runs["c"])
            assert (failed_c.status, failed_c.stage) == ("failed", "training")
            assert "verl trainer actor died" in failed_c.failure_reason
            assert await pending("c") == set(batches["c"])
            events_c = [e["type"] for e in (await client.get(f"/v1/rl/training/runs/{runs['c']}/events")).json()[
                "items"]]
            run_b = await wait_for_run(deps.runner, runs["b"])
            assert await pending("b") == set()
    assert events_c.index("waiting_for_resources") < events_c.index("resources_placed") < events_c.index("failed")
    assert failed_c.metrics[PLACEMENT]["state"] == "placed" and failed_c.metrics[PLACEMENT]["waited_seconds"] > 0
    assert (run_b.status, run_b.lora_name, sorted(run_b.sample_ids)) == ("succeeded", "tiny:b:v1", batches["b"])
    assert gateway.line_active == {"tiny:b": (run_b.lora_name, run_b.lora_path)}  # a and c activated nothing
    assert Path(run_b.lora_path).parent.name == "b"  # its own line's repository directory
    assert run_b.metrics[PLACEMENT]["state"] == "placed"
    assert named_actors() == []


def _job(tiny_model: Path, run_id: str, model_id: str = "tiny") -> TrainingJob:
    return TrainingJob(training_run_id=run_id, model_id=model_id, base_model_path=str(tiny_model),
                       samples=few_samples(tiny_model), init_lora_name="base", init_lora_path="")


async def test_pinned_gpus_are_cut_into_slots_and_a_run_waits_for_a_free_one(tmp_path, tiny_model, local_ray):
    """`training_gpu_ids: "0"` with one rank per run: one slot. A second run waits for it (and says so), gets it
    when the first is stopped, and its actor sees that GPU id; the stop touched only the first run."""
    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository

    backend = make_backend(LoraRepository(str(tmp_path / "loras"), model_id="tiny"), tmp_path, training_gpu_ids="0")
    notes: dict[str, list[dict]] = {"one": [], "two": []}

    def recorder(name: str):
        async def record(metrics: dict) -> None:
            notes[name].append(metrics)
        return record

    one = asyncio.create_task(backend.train(_job(tiny_model, "run-one"), on_progress=recorder("one")))
    await _wait_for_own_actor(backend, "run-one")
    two = asyncio.create_task(backend.train(_job(tiny_model, "run-two"), on_progress=recorder("two")))

    async def two_waits():
        return next((m[PLACEMENT] for m in notes["two"] if PLACEMENT in m), None)

    waiting = await _until(two_waits, "the second run to wait for the slot", 30)
    assert (waiting["state"], waiting["waiting_for"]) == ("waiting", "slot of training_gpu_ids")
    assert await backend.cancel("run-one") is True
    with pytest.raises(TrainingCanceled):
        await one
    await _wait_for_own_actor(backend, "run-two")
    placed = [m[PLACEMENT] for m in notes["two"] if PLACEMENT in m][-1]
    assert (placed["state"], placed["gpu_ids"], placed["bundle"]) == ("placed", ["0"], {"CPU": 1.0})
    assert placed["waited_seconds"] > 0
    assert named_actors() == [actor_name("tiny", "run-two")]
    assert await backend.cancel("run-two") is True
    with pytest.raises(TrainingCanceled):
        await two
    assert backend._free_slots == [0]


async def test_a_run_no_node_can_hold_fails_at_once_and_a_wait_past_its_limit_fails(tmp_path, tiny_model, local_ray):
    """Three CPUs per rank on a 2-CPU Ray: the run could never be placed, so it fails at once instead of waiting
    forever. A run of another service (another model id) whose CPU is taken fails after
    `ray_placement_timeout_seconds`; the run holding the CPUs is untouched."""
    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
    from openjiuwen.agent_evolving.agent_rl.online.training.backends.verl import PlacementError

    big = make_backend(LoraRepository(str(tmp_path / "loras"), model_id="tiny"), tmp_path, cpus_per_rank=3)
    with pytest.raises(PlacementError, match="no Ray placement can ever hold this run"):
        await big.train(_job(tiny_model, "run-big"), on_progress=_noop)
    holder = make_backend(LoraRepository(str(tmp_path / "loras"), model_id="tiny"), tmp_path, cpus_per_rank=2)
    held = asyncio.create_task(holder.train(_job(tiny_model, "run-holds"), on_progress=_noop))
    await _wait_for_own_actor(holder, "run-holds")
    other = make_backend(LoraRepository(str(tmp_path / "other"), model_id="other"), tmp_path, model_id="other",
                         placement_timeout_s=1.5)
    with pytest.raises(PlacementError, match=r"within ray_placement_timeout_seconds \(1.5 s\)"):
        await other.train(_job(tiny_model, "run-late", "other"), on_progress=_noop)
    assert named_actors() == [actor_name("tiny", "run-holds")] and named_actors("other") == []
    assert await holder.cancel("run-holds") is True
    with pytest.raises(TrainingCanceled):
        await held
