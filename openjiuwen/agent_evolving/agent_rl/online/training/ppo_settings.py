"""PPO settings of the local backend: the contract's defaults (CONTRACT §7), then `ppo_config_path`, then the
`ONLINE_RL_*` environment overrides.

`ppo_config_path` is the same YAML the verl backend composes (verl's nested layout, e.g.
`actor_rollout_ref.actor.optim.lr`); the local backend reads the keys listed in `YAML_PATHS` and ignores the
verl-only rest. The environment is passed in by the composition root (`assembly.py` `make_backend`), which reads it for the backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class PPOSettings:
    advantage_estimator: str = "reinforce_plus_plus"
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = True
    kl_penalty: str = "kl"
    kl_coef: float = 0.001
    lora_rank: int = 16
    lora_alpha: int = 32
    target_modules: str = "all-linear"
    learning_rate: float = 1e-5
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 4
    ppo_micro_batch_size: int = 2
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    entropy_coeff: float = 0.01
    loss_agg_mode: str = "token-mean"
    grad_clip: float = 1.0
    max_prompt_length: int = 2048
    max_response_length: int = 2048
    filter_overlong_prompts: bool = False
    tis_cap: float | None = None
    ppo_samples_per_step: int = 0
    seed: int = 1
    dtype: str = "float32"
    # Local backend only: no gradient through the prompt tokens' keys/values (ppo_math.response_log_probs).
    detach_prompt: bool = False
    # Local backend only: torch threads of the trainer (0: one per CPU). On cores shared with vLLM and other work, 2
    # threads spinning at OpenMP barriers ran a SmolLM2 micro-batch 7x slower than 1 thread (docs/learning.md).
    num_threads: int = 0
    # Local backend only: rows whose π_old the sampling report recomputes (a seeded sample; pi_old.py). Recomputing
    # every row doubled a SmolLM2 run (issue 38); the rows the loss needs π_old for are forwarded whatever this is.
    sampling_report_rows: int = 16

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PPOSettings":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# verl config path → setting (the subset that means the same thing on one machine).
YAML_PATHS: dict[str, str] = {
    "algorithm.adv_estimator": "advantage_estimator",
    "algorithm.gamma": "gamma",
    "algorithm.lam": "lam",
    "algorithm.use_kl_in_reward": "use_kl_in_reward",
    "algorithm.kl_penalty": "kl_penalty",
    "algorithm.kl_ctrl.kl_coef": "kl_coef",
    "actor_rollout_ref.model.lora_rank": "lora_rank",
    "actor_rollout_ref.model.lora_alpha": "lora_alpha",
    "actor_rollout_ref.model.target_modules": "target_modules",
    "actor_rollout_ref.actor.optim.lr": "learning_rate",
    "actor_rollout_ref.actor.ppo_epochs": "ppo_epochs",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "ppo_micro_batch_size",
    "actor_rollout_ref.actor.clip_ratio": "clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_low": "clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "clip_ratio_high",
    "actor_rollout_ref.actor.entropy_coeff": "entropy_coeff",
    "actor_rollout_ref.actor.loss_agg_mode": "loss_agg_mode",
    "actor_rollout_ref.actor.grad_clip": "grad_clip",
    "data.max_prompt_length": "max_prompt_length",
    "data.max_response_length": "max_response_length",
    "data.filter_overlong_prompts": "filter_overlong_prompts",
    # Not a verl key: the local backend's own (verl ignores a top-level `local` section).
    "local.detach_prompt": "detach_prompt",
    "local.num_threads": "num_threads",
    "local.sampling_report_rows": "sampling_report_rows",
}

# ONLINE_RL_<NAME> → setting (CONTRACT §7; the verl-only sizes have no meaning for the local backend).
ENV_OVERRIDES: dict[str, tuple[str, type]] = {
    "ONLINE_RL_ACTOR_LEARNING_RATE": ("learning_rate", float),
    "ONLINE_RL_MAX_PROMPT_LENGTH": ("max_prompt_length", int),
    "ONLINE_RL_MAX_RESPONSE_LENGTH": ("max_response_length", int),
    "ONLINE_RL_PPO_MINI_BATCH_SIZE": ("ppo_mini_batch_size", int),
    "ONLINE_RL_PPO_MICRO_BATCH_SIZE_PER_GPU": ("ppo_micro_batch_size", int),
    "ONLINE_RL_FSDP_MODEL_DTYPE": ("dtype", str),
    "ONLINE_RL_DETERMINISTIC_SEED": ("seed", int),
}


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def apply_tree(settings: PPOSettings, tree: Mapping[str, Any]) -> PPOSettings:
    """The settings with every `YAML_PATHS` key present in a verl-layout tree applied (the verl backend passes
    its whole composed config, the local backend the `ppo_config_path` file)."""
    flat = _flatten(tree)
    return replace(settings, **{YAML_PATHS[path]: value for path, value in flat.items() if path in YAML_PATHS})


def load_ppo_settings(
    *,
    advantage_estimator: str,
    tis_cap: float | None,
    ppo_samples_per_step: int,
    ppo_config_path: str | None,
    env: Mapping[str, str],
) -> PPOSettings:
    settings = PPOSettings(
        advantage_estimator=advantage_estimator, tis_cap=tis_cap, ppo_samples_per_step=ppo_samples_per_step
    )
    if ppo_config_path:
        raw = yaml.safe_load(Path(ppo_config_path).read_text(encoding="utf-8")) or {}
        if not isinstance(raw, Mapping):
            raise ValueError(f"ppo_config_path: {ppo_config_path} must hold a mapping")
        settings = apply_tree(settings, raw)
    for name, (field_name, kind) in ENV_OVERRIDES.items():
        value = env.get(name)
        if value:
            try:
                settings = replace(settings, **{field_name: kind(value)})
            except ValueError as exc:
                raise ValueError(f"{name}: cannot parse {value!r} as {kind.__name__}") from exc
    return settings
