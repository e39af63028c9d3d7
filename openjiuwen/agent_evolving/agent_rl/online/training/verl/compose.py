"""The verl PPO config: the shipped `online_ppo.yaml` composed by Hydra on top of verl's own `ppo_trainer`
defaults, then `ppo_config_path` merged, then the ONLINE_RL_* environment overrides (CONTRACT §7).

Runs in the service process at startup, so a bad file or override stops the service with a clear message. Only
hydra and omegaconf are imported: verl's config directory is located without importing verl (whose import pulls
in torch and ray).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..ppo_settings import PPOSettings, apply_tree

CONFIG_DIR = Path(__file__).resolve().parent
CONFIG_NAME = "online_ppo"

# ONLINE_RL_<NAME> → the verl config paths it sets (CONTRACT §7).
ENV_OVERRIDES: dict[str, tuple[str, ...]] = {
    "ONLINE_RL_ACTOR_LEARNING_RATE": ("actor_rollout_ref.actor.optim.lr",),
    "ONLINE_RL_MAX_PROMPT_LENGTH": ("data.max_prompt_length",),
    "ONLINE_RL_MAX_RESPONSE_LENGTH": ("data.max_response_length",),
    "ONLINE_RL_TRAIN_BATCH_SIZE": ("data.train_batch_size",),
    "ONLINE_RL_PPO_MINI_BATCH_SIZE": ("actor_rollout_ref.actor.ppo_mini_batch_size",),
    "ONLINE_RL_PPO_MICRO_BATCH_SIZE_PER_GPU": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",),
    "ONLINE_RL_ACTOR_PPO_MAX_TOKEN_LEN_PER_GPU": ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",),
    "ONLINE_RL_LOG_PROB_MICRO_BATCH_SIZE_PER_GPU": (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ),
    "ONLINE_RL_REF_LOG_PROB_MAX_TOKEN_LEN_PER_GPU": ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",),
    "ONLINE_RL_FSDP_MODEL_DTYPE": ("actor_rollout_ref.actor.fsdp_config.model_dtype",),
    "ONLINE_RL_DETERMINISTIC_SEED": ("trainer.seed",),
}


class PPOConfigError(ValueError):
    """The PPO config cannot be composed (bad file, override or verl missing)."""


def verl_config_dir() -> Path:
    spec = importlib.util.find_spec("verl")  # finds the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise PPOConfigError("trainer_backend verl: the verl package is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config"
    if not (path / "ppo_trainer.yaml").is_file():
        raise PPOConfigError(f"trainer_backend verl: {path} holds no ppo_trainer.yaml")
    return path


def _service_overrides(advantage_estimator: str, tis_cap: float | None) -> dict[str, Any]:
    """What the service config itself decides: the estimator, and bypass vs decoupled mode for `tis_cap`."""
    tree: dict[str, Any] = {"algorithm.adv_estimator": advantage_estimator}
    if tis_cap is not None:
        # Decoupled mode: π_old recomputed with the parent weights, token-level truncated IS against behaviour.
        tree.update({
            "algorithm.rollout_correction.bypass_mode": False,
            "algorithm.rollout_correction.rollout_is": "token",
            "algorithm.rollout_correction.rollout_is_threshold": float(tis_cap),
            "algorithm.rollout_correction.rollout_rs": None,
        })
    return tree


def compose_ppo_config(
    *,
    advantage_estimator: str,
    tis_cap: float | None,
    ppo_config_path: str | None,
    env: Mapping[str, str],
) -> dict[str, Any]:
    """The composed config as a plain (unresolved) mapping: it travels to the Ray actor as is."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose(CONFIG_NAME, overrides=[f"hydra.searchpath=[file://{verl_config_dir()}]"])
    except (HydraException, OmegaConfBaseException) as exc:
        raise PPOConfigError(f"cannot compose the verl PPO config: {exc}") from exc
    OmegaConf.set_struct(cfg, False)  # verl sections like override_config take free keys from ppo_config_path
    for path, value in _service_overrides(advantage_estimator, tis_cap).items():
        OmegaConf.update(cfg, path, value, merge=False)
    if ppo_config_path:
        try:
            extra = OmegaConf.load(ppo_config_path)
        except (OSError, yaml.YAMLError, OmegaConfBaseException) as exc:
            raise PPOConfigError(f"ppo_config_path: {ppo_config_path}: {exc}") from exc
        if not isinstance(extra, Mapping) and not OmegaConf.is_dict(extra):
            raise PPOConfigError(f"ppo_config_path: {ppo_config_path} must hold a mapping")
        cfg = OmegaConf.merge(cfg, extra)
    for name, paths in ENV_OVERRIDES.items():
        raw = env.get(name)
        if not raw:
            continue
        value = _scalar(raw.strip())
        for path in paths:
            OmegaConf.update(cfg, path, value, merge=False)
    tree = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(tree, dict)
    return tree


def _scalar(raw: str) -> int | float | str:
    """"64" → 64, "1e-4" → 0.0001, "bf16" → "bf16" (YAML 1.1 would keep "1e-4" a string)."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            continue
    return raw


def settings_from_config(tree: Mapping[str, Any], *, tis_cap: float | None, ppo_samples_per_step: int) -> PPOSettings:
    """The shared PPO settings (advantages, KL, clip, lengths ...) read from the composed verl config, so both
    backends interpret one key the same way."""
    settings = apply_tree(PPOSettings(tis_cap=tis_cap, ppo_samples_per_step=ppo_samples_per_step), tree)
    seed = (tree.get("trainer") or {}).get("seed")
    return settings if seed is None else PPOSettings.from_dict({**settings.to_dict(), "seed": int(seed)})
