"""The demo stack's configuration, as pure functions of the driver's arguments and what the stack chose (ports,
paths): the local trainer's PPO yaml, the RL Service's config, the gateway's config. `stack.py` writes them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def canary_settings(min_tasks: int) -> dict[str, Any]:
    """The RL Service's `rollout` section under --bad-version. Half of the new Tasks go to the candidate (the
    fastest decision); a tolerance of 0.01 so that only a version about as good as the active one is promoted (a
    worse one meets the regression rule first); no failure rule in practice (the demo's Tasks do not fail); the
    loop looks every second, so the demo waits little after each batch of Tasks."""
    return {"mode": "canary", "share": 0.5, "min_tasks": min_tasks, "tolerance": 0.01, "failure_margin": 0.5,
            "max_duration_seconds": 3600, "on_timeout": "rollback", "decision_interval_seconds": 1.0}


def lineage_training_policy(samples: int, per_lineage: dict[str, int] | None = None) -> dict[str, Any]:
    """The RL Service's `training_policy` under --lineages 2: the scheduler trains every lineage by itself, a line
    once one round of its training Tasks' samples (`samples`, or its own count in `per_lineage` when its Tasks have
    another number of completions) is pending, so the driver starts no run. Evaluation samples are never pending,
    so only the training round fills a line. A tick a second: the demo waits little for each start (one run at a time,
    `max_concurrent_runs` 1 on the demo's 2 cores, so the second lineage's run starts after the first)."""
    policy: dict[str, Any] = {"auto": True, "min_pending_samples": samples, "poll_interval_seconds": 1.0}
    overrides = {name: {"min_pending_samples": n} for name, n in (per_lineage or {}).items() if n != samples}
    if overrides:
        policy["lineages"] = overrides
    return policy


def ppo_config(a: argparse.Namespace) -> dict[str, Any]:
    """The local trainer's PPO settings (`ppo_config_path`); one Training Run claims one round's samples."""
    samples = a.tasks * a.turns
    return {
        "actor_rollout_ref": {"actor": {"optim": {"lr": a.lr}, "ppo_epochs": a.ppo_epochs,
                                        "ppo_mini_batch_size": min(a.mini_batch, samples),
                                        "ppo_micro_batch_size_per_gpu": min(a.micro_batch, a.mini_batch, samples),
                                        "clip_ratio_high": a.clip_high, "entropy_coeff": a.entropy_coeff}},
        "algorithm": {"use_kl_in_reward": a.kl_coef > 0, "kl_ctrl": {"kl_coef": a.kl_coef}},
        "local": {"detach_prompt": a.detach_prompt, "num_threads": a.trainer_threads},
        "data": {"max_prompt_length": 512, "max_response_length": max(64, a.max_tokens)},
    }


def rl_service_config(a: argparse.Namespace, *, run_dir: Path, rl_port: int, gateway_port: int, redis_url: str,
                      model_dir: Path | None, ppo_path: Path, per_lineage: dict[str, int] | None) -> dict[str, Any]:
    """The RL Service's config (`configPath` of the gateway's onlineRL section). `per_lineage`: each lineage's
    training samples per round under --lineages 2 when they differ by family (None: one Task count for all)."""
    samples = a.tasks * a.turns
    gw_dir = run_dir / "gateway"
    config: dict[str, Any] = {
        "listen_host": "127.0.0.1",
        "listen_port": rl_port,
        "redis_url": redis_url,
        "model_id": a.model_id,
        "base_model_path": str(model_dir),
        "aigw_endpoint": f"http://127.0.0.1:{gateway_port}",
        "judge_endpoint": "",
        "lora_activation_timeout": 90.0,
        "lora_activation_attempts": 3,
        "min_samples_for_training": samples,
        "max_samples_per_run": samples,
        "trainer_backend": a.trainer,
        "advantage_estimator": "reinforce_plus_plus",
        "ppo_config_path": str(ppo_path),
        "training_tmp_root": str(run_dir / "train-tmp"),
        "lora_repository_path": str(run_dir / "loras"),
        "record_dir": str(run_dir / "records"),
        "log_path": str(gw_dir / "rl-service.log"),
        "log_level": "INFO",
    }
    if a.bad_version:
        config["rollout"] = canary_settings(a.canary_min_tasks)
    if a.lineages > 1:
        config["training_policy"] = lineage_training_policy(samples, per_lineage)
    return config


def gateway_config(a: argparse.Namespace, *, run_dir: Path, port: int, rl_port: int, key_file: Path,
                   rl_config_path: Path, instances: list[tuple[str, str, int]]) -> dict[str, Any]:
    """The reference gateway's config (AIGW JSON shape): the instances, the LoRA root, and its RL Service child."""
    gw_dir = run_dir / "gateway"
    return {
        "global": {"listen": f"127.0.0.1:{port}", "hmacKeyFile": str(key_file)},
        "instances": [{"name": n, "model": a.model_id, "instanceIp": h, "port": p} for n, h, p in instances],
        "lora": {"root": str(run_dir / "loras"), "statePath": str(gw_dir / "lora-state.json"),
                 "operationTimeout": "60s"},
        "onlineRL": {
            "command": [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.online.service"],
            "configPath": str(rl_config_path),
            "modelId": a.model_id,
            "endpoint": f"http://127.0.0.1:{rl_port}",
            "hookTimeout": "30s",
            "hookRetries": 1,
            "drainTimeout": "10s",
            "controlTimeout": "120s",
        },
    }
