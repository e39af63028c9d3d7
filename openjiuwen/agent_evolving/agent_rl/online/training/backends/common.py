"""What every backend computes the same way: the repository metadata of an artifact (CONTRACT §4.8)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ....common import constraints
from ....common.ids import lora_version, now_iso
from ....common.policy_names import BASE_POLICY
from ..ppo_settings import PPOSettings
from . import TrainingJob


def sample_score(sample: dict[str, Any]) -> float:
    judge = sample.get("judge")
    if isinstance(judge, dict) and isinstance(judge.get("score"), (int, float)) and not isinstance(
        judge.get("score"), bool
    ):
        return float(judge["score"])
    return 0.0


def artifact_metadata(
    job: TrainingJob, *, trainer_backend: str, ppo_samples_per_step: int, metrics: dict[str, Any]
) -> dict[str, Any]:
    versions: dict[str, int] = {}
    for s in job.samples:
        v = str(s.get("policy_version") or BASE_POLICY)
        versions[v] = versions.get(v, 0) + 1
    scores = [sample_score(s) for s in job.samples]
    from_lora = job.from_lora
    return {
        "training_run_id": job.training_run_id,
        "created_at": now_iso(),
        "base_model": job.base_model_path,
        "parent_lora_id": job.init_lora_name if from_lora else "",
        "parent_lora_version": lora_version(job.init_lora_name, job.model_id) if from_lora else None,
        "parent_lora_path": job.init_lora_path if from_lora else "",
        "training_source": "active_lora" if from_lora else "base_model",
        "trajectory_count": len({s.get("trajectory_id") for s in job.samples}),
        "sample_count": len(job.samples),
        "reward_avg": sum(scores) / len(scores) if scores else 0.0,
        "policy_versions": versions,
        "trainer_backend": trainer_backend,
        "training_mode": "ppo",
        "ppo_steps": metrics.get("steps", 0),
        "ppo_samples_per_step": ppo_samples_per_step,
        "ppo_metrics": metrics.get("summary", {}),
        "ppo_step_metrics": metrics.get("step_metrics", []),
        "dropped_samples": metrics.get("dropped_samples", 0),
        "prompt_truncated_samples": metrics.get("prompt_truncated_samples", 0),
        "response_truncated_samples": metrics.get("response_truncated_samples", 0),
        "sampling": metrics.get("sampling"),
        "timings": metrics.get("timings"),
        "constraints": constraint_counts(job.samples),
    }


def constraint_counts(samples: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The run's samples per constraint kind (common/constraints.py), in the kinds' order: what the run trained
    with the correction for constrained sampling (excluded kinds never reach a run)."""
    counts: dict[str, int] = {}
    for sample in samples:
        for kind in constraints.kinds_of(sample.get("sampling")):
            counts[kind] = counts.get(kind, 0) + 1
    return {kind: counts[kind] for kind in constraints.KINDS if kind in counts}


def trained_metadata(
    job: TrainingJob, result: dict[str, Any], *, settings: PPOSettings, trainer_backend: str
) -> dict[str, Any]:
    """The metadata of a PPO trainer's artifact from its result (`metrics`, `dropped_sample_ids`)."""
    meta = artifact_metadata(
        job, trainer_backend=trainer_backend, ppo_samples_per_step=settings.ppo_samples_per_step,
        metrics=result.get("metrics", {}),
    )
    meta["dropped_sample_ids"] = list(result.get("dropped_sample_ids", []))
    meta["settings"] = settings.to_dict()
    return meta

