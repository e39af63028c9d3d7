"""The verl backend's PPO config (Hydra composition, overrides), Ray names, and its selection by the service."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.online.config import ConfigError, config_from_mapping
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.assembly import make_backend
from openjiuwen.agent_evolving.agent_rl.online.training.backends.verl import (
    VerlBackend,
    actor_name,
    fits,
    ray_key,
    ray_namespace,
)
from openjiuwen.agent_evolving.agent_rl.online.training.verl.compose import (
    PPOConfigError,
    compose_ppo_config,
    settings_from_config,
)


def compose(tmp_path: Path | None = None, yaml_text: str | None = None, env: dict[str, str] | None = None,
            **kw):
    path = None
    if yaml_text is not None:
        assert tmp_path is not None
        path = tmp_path / "ppo.yaml"
        path.write_text(yaml_text)
    return compose_ppo_config(advantage_estimator=kw.get("estimator", "reinforce_plus_plus"),
                              tis_cap=kw.get("tis_cap"), ppo_config_path=str(path) if path else None, env=env or {})


def test_defaults_are_the_contract_table() -> None:
    c = compose()
    algo, actor, model = c["algorithm"], c["actor_rollout_ref"]["actor"], c["actor_rollout_ref"]["model"]
    assert (algo["adv_estimator"], algo["gamma"], algo["lam"]) == ("reinforce_plus_plus", 1.0, 1.0)
    assert (algo["use_kl_in_reward"], algo["kl_penalty"], algo["kl_ctrl"]["type"], algo["kl_ctrl"]["kl_coef"]) == (
        True, "kl", "fixed", 0.001)
    assert (model["lora_rank"], model["lora_alpha"], model["target_modules"]) == (16, 32, "all-linear")
    assert (actor["optim"]["lr"], actor["optim"]["lr_scheduler_type"], actor["ppo_epochs"]) == (1e-5, "constant", 1)
    assert (actor["ppo_mini_batch_size"], actor["ppo_micro_batch_size_per_gpu"]) == (4, 2)
    assert (actor["clip_ratio"], actor["clip_ratio_low"], actor["clip_ratio_high"]) == (0.2, 0.2, 0.28)
    assert (actor["entropy_coeff"], actor["loss_agg_mode"], actor["policy_loss"]["loss_mode"]) == (
        0.01, "token-mean", "vanilla")
    assert (actor["fsdp_config"]["param_offload"], actor["fsdp_config"]["optimizer_offload"]) == (True, True)
    data = c["data"]
    assert (data["max_prompt_length"], data["max_response_length"], data["truncation"],
            data["filter_overlong_prompts"]) == (2048, 2048, "truncate", False)
    assert c["trainer"]["resume_mode"] == "disable"
    # The captured logprobs are the PPO old logprobs: verl's bypass mode, PPO-clip loss.
    assert (algo["rollout_correction"]["bypass_mode"], algo["rollout_correction"]["loss_type"]) == (True, "ppo_clip")
    # Everything else is verl's own ppo_trainer default (composed, not copied): e.g. the critic section exists.
    assert "critic" in c and c["actor_rollout_ref"]["rollout"]["n"] == 1


def test_service_fields_then_file_then_environment(tmp_path: Path) -> None:
    c = compose(tmp_path, """
algorithm: {adv_estimator: grpo}
actor_rollout_ref:
  actor: {optim: {lr: 3.0e-4}, ppo_epochs: 2}
  model: {override_config: {attn_implementation: flash_attention_2}}
data: {max_response_length: 512}
""", env={"ONLINE_RL_ACTOR_LEARNING_RATE": "1e-4", "ONLINE_RL_LOG_PROB_MICRO_BATCH_SIZE_PER_GPU": "8",
          "ONLINE_RL_FSDP_MODEL_DTYPE": "bf16", "ONLINE_RL_DETERMINISTIC_SEED": "7"}, tis_cap=2.0)
    actor = c["actor_rollout_ref"]["actor"]
    assert actor["optim"]["lr"] == 1e-4 and actor["ppo_epochs"] == 2  # the environment wins over the file
    assert c["algorithm"]["adv_estimator"] == "grpo" and c["data"]["max_response_length"] == 512
    assert c["actor_rollout_ref"]["model"]["override_config"]["attn_implementation"] == "flash_attention_2"
    assert c["actor_rollout_ref"]["rollout"]["log_prob_micro_batch_size_per_gpu"] == 8
    assert c["actor_rollout_ref"]["ref"]["log_prob_micro_batch_size_per_gpu"] == 8
    assert actor["fsdp_config"]["model_dtype"] == "bf16" and c["trainer"]["seed"] == 7
    rc = c["algorithm"]["rollout_correction"]  # tis_cap: decoupled mode with token-level truncated IS
    assert (rc["bypass_mode"], rc["rollout_is"], rc["rollout_is_threshold"], rc["rollout_rs"]) == (
        False, "token", 2.0, None)
    s = settings_from_config(c, tis_cap=2.0, ppo_samples_per_step=4)
    assert (s.learning_rate, s.ppo_epochs, s.advantage_estimator, s.max_response_length, s.seed) == (
        1e-4, 2, "grpo", 512, 7)
    assert (s.tis_cap, s.ppo_samples_per_step, s.kl_coef, s.clip_ratio_high) == (2.0, 4, 0.001, 0.28)


def test_bad_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(PPOConfigError, match="ppo_config_path"):
        compose(tmp_path, "actor_rollout_ref: [unclosed\n")
    with pytest.raises(PPOConfigError, match="must hold a mapping"):
        compose(tmp_path, "- a list\n")


def test_composition_imports_neither_verl_nor_torch_nor_ray() -> None:
    code = ("import sys\n"
            "from openjiuwen.agent_evolving.agent_rl.online.training.verl.compose import compose_ppo_config\n"
            "compose_ppo_config(advantage_estimator='grpo', tis_cap=None, ppo_config_path=None, env={})\n"
            "import openjiuwen.agent_evolving.agent_rl.online.training.backends.verl\n"
            "print(sorted(m for m in ('verl', 'torch', 'ray') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_ray_names_carry_the_model_id() -> None:
    assert ray_key("qwen3-8b-agent") == "qwen3-8b-agent-" + __import__("hashlib").sha256(
        b"qwen3-8b-agent").hexdigest()[:8]
    assert ray_namespace("org/model") .startswith("online-rl-org_model-")
    # One name per run and rank: concurrent runs of one model never share (or sweep) each other's actors.
    assert actor_name("org/model", "run-1").startswith("online_ppo_runner-org_model-")
    assert actor_name("org/model", "run-1").endswith("-run-1")
    assert actor_name("org/model", "run-1", 1).endswith("-run-1-rank1")
    assert actor_name("org/model", "run-1") != actor_name("org/model", "run-2")
    # Two models whose sanitized ids collide still get different names (the hash of the raw id).
    assert ray_key("a/b") != ray_key("a_b") and ray_namespace("a/b") != ray_namespace("a_b")


def test_the_service_builds_the_verl_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def config(**kw):
        return config_from_mapping({"redis_url": "redis://127.0.0.1:1/0", "model_id": "m1",
                                    "base_model_path": "/models/m", "lora_repository_path": str(tmp_path),
                                    "trainer_backend": "verl", **kw})

    monkeypatch.setenv("ONLINE_RL_VISIBLE_DEVICES_ENV", "MY_DEVICES")
    cfg = config(ray_address="ray://head:10001", nproc_per_node=2, training_gpu_ids="2,3")
    backend = make_backend(cfg, LoraRepository(str(tmp_path), model_id="m1"))
    assert isinstance(backend, VerlBackend) and backend.name == "verl" and backend.namespace == ray_namespace("m1")
    assert (backend._ray_address, backend._nproc, backend._gpu_ids, backend._visible_env) == (
        "ray://head:10001", 2, ["2", "3"], "MY_DEVICES")
    backend.check_health()  # nothing connected yet: healthy
    # training_gpu_ids: rank i sees exactly GPU ids[i] of its run's slot, in the variable ONLINE_RL_VISIBLE_DEVICES_ENV
    # names, and asks Ray for no GPU.
    bundle = backend.bundle(cluster_has_gpus=True)
    assert bundle == {"CPU": 1.0}
    rank1 = backend.actor_options("run-1", 1, group=None, bundle=bundle, slot=0)
    assert (rank1["name"], rank1["namespace"], rank1["lifetime"]) == (actor_name("m1", "run-1", 1),
                                                                       ray_namespace("m1"), "detached")
    assert rank1["runtime_env"] == {"env_vars": {"MY_DEVICES": "3"}} and "num_gpus" not in rank1
    four = make_backend(config(training_gpu_ids="4,5,6,7"), LoraRepository(str(tmp_path), model_id="m1"))
    assert four._free_slots == [0, 1, 2, 3]  # one rank per run: four runs at once, each on its own GPU
    assert four.actor_options("run-9", 0, group=None, bundle={"CPU": 1.0}, slot=2)["runtime_env"] == {
        "env_vars": {"MY_DEVICES": "6"}}
    plain = make_backend(config(nproc_per_node=2), LoraRepository(str(tmp_path), model_id="m1"))
    assert plain.bundle(cluster_has_gpus=True) == {"CPU": 1.0, "GPU": 1.0}  # Ray picks the GPU
    assert plain.bundle(cluster_has_gpus=False) == {"CPU": 1.0}
    options = plain.actor_options("run-1", 0, group=None, bundle=plain.bundle(cluster_has_gpus=True))
    assert (options["num_gpus"], options["num_cpus"]) == (1.0, 1.0) and "runtime_env" not in options
    shared = make_backend(config(ray_gpus_per_rank=0.5, ray_cpus_per_rank=2), LoraRepository(str(tmp_path),
                                                                                               model_id="m1"))
    assert shared.bundle(cluster_has_gpus=True) == {"CPU": 2.0, "GPU": 0.5}  # two runs per GPU
    with pytest.raises(ConfigError, match="training_gpu_ids: names 1 GPU"):
        make_backend(config(nproc_per_node=2, training_gpu_ids="0"), LoraRepository(str(tmp_path), model_id="m1"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor_rollout_ref: [unclosed\n")
    with pytest.raises(ConfigError, match="ppo_config_path"):
        make_backend(config(ppo_config_path=str(bad)), LoraRepository(str(tmp_path), model_id="m1"))


def test_a_run_that_no_node_could_ever_hold_is_told_apart_from_a_busy_one() -> None:
    """`fits` judges the nodes' total resources (busy or not): False means the run would wait forever, so it fails at
    once; True with the resources taken by other runs means it waits (docs/training.md "Concurrent verl runs")."""
    gpu_node, cpu_node = {"CPU": 16.0, "GPU": 8.0}, {"CPU": 2.0}
    assert fits({"CPU": 1.0, "GPU": 1.0}, 8, [gpu_node]) and not fits({"CPU": 1.0, "GPU": 1.0}, 9, [gpu_node])
    assert fits({"CPU": 1.0, "GPU": 0.5}, 16, [gpu_node])
    assert not fits({"CPU": 1.0, "GPU": 1.0}, 1, [cpu_node])  # a GPU asked of a CPU-only Ray
    assert fits({"CPU": 1.0}, 2, [cpu_node]) and not fits({"CPU": 2.0}, 2, [cpu_node])
    assert fits({"CPU": 2.0}, 2, [cpu_node, cpu_node])  # each bundle on one node, the run across two
