"""verl's training engine driven through the PPO steps of one run, on one rank (used by `actor.PPORunner`).

Builds verl's `TrainingWorker` from the composed config, computes the reference and π_old logprobs with it (each
row at its sample's temperature: the batch's `temperature` tensor), the sampling report (captured against π_old),
rewards and advantages with verl's core_algos (`training/ppo_math.py`, shared with the local backend), lets verl's
rollout-correction helpers decide the PPO "old" logprobs, runs `train_mini_batch` with verl's `ppo_loss`, and exports
the adapter. torch and verl are imported inside the functions (training side only).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..adapter_files import ADAPTER_FILES, save_peft_adapter


def build_worker(cfg: Any) -> Any:
    """verl's TrainingWorker for the actor role, from the composed config (as verl's ActorRolloutRefWorker does)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    actor_cfg = cfg.actor_rollout_ref.actor
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(actor_cfg)
    worker_config = TrainingWorkerConfig(
        model_type="language_model", model_config=model_config, engine_config=actor_config.engine,
        optimizer_config=actor_config.optim, checkpoint_config=actor_config.checkpoint,
    )
    engine = worker_config.engine_config
    engine.use_dynamic_bsz = bool(actor_cfg.use_dynamic_bsz)
    engine.max_token_len_per_gpu = actor_cfg.ppo_max_token_len_per_gpu
    engine.micro_batch_size_per_gpu = actor_cfg.ppo_micro_batch_size_per_gpu
    engine.infer_max_token_len_per_gpu = cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu
    engine.infer_micro_batch_size_per_gpu = (
        cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu or actor_cfg.ppo_micro_batch_size_per_gpu
    )
    engine.use_remove_padding = bool(model_config.get("use_remove_padding", False))
    worker = TrainingWorker(worker_config)
    worker.reset()
    return worker


class PPOSteps:
    """The PPO steps of one run on one rank."""

    def __init__(self, worker: Any, cfg: Any, settings: Any, batch: Any, *, rank: int, world_size: int,
                 record: Any) -> None:
        from .data import to_data_proto

        self.worker, self.cfg, self.settings, self.batch = worker, cfg, settings, batch
        self.rank, self.world_size, self.record = rank, world_size, record
        self.data = to_data_proto(batch)
        self.loss_ready = False
        self.mixed = False  # a bypass-mode run with constrained rows (set by `run`)
        self.sampling: dict[str, Any] = {}

    def run(self) -> list[dict[str, Any]]:
        from .. import ppo_math
        from ..batch import chunk_rows

        s = self.settings
        want_kl = s.use_kl_in_reward and s.kl_coef > 0
        ref = self._infer(no_adapter=True) if want_kl else None  # the frozen base: verl's LoRA reference
        bypass = bool(self.cfg.algorithm.rollout_correction.get("bypass_mode", False))
        recomputed = self._infer(no_adapter=False)  # parent weights, before any update
        self.sampling = ppo_math.sampling_report(
            captured=self.batch.old_log_probs, recomputed=recomputed, response_mask=self.batch.response_mask,
            temperatures=self.batch.temperatures, truncated=self.batch.truncated, settings=s,
            corrected=self.batch.corrected,
        )
        # Constrained rows are always decoupled (ppo_math.behaviour_correction): in bypass mode the run then sets its
        # own old logprobs and weights row by row, under verl's vanilla loss.
        self.mixed = bypass and bool(self.batch.corrected.any())
        pi_old = None if bypass and not self.mixed else recomputed
        grpo = s.advantage_estimator == "grpo"
        slices = chunk_rows(len(self.batch), s.ppo_samples_per_step, uids=self.batch.uid if grpo else None,
                            created_at=self.batch.created_at if grpo else None)
        steps: list[dict[str, Any]] = []
        for number, rows in enumerate(slices, start=1):
            started = time.perf_counter()
            part = self.data.select_idxs(rows)
            mask = part.batch["response_mask"]
            rewards, kl = ppo_math.token_level_rewards(
                part.batch["token_level_scores"], mask, behaviour_log_probs=part.batch["rollout_log_probs"],
                ref_log_probs=None if ref is None else ref[rows], settings=s,
            )
            part.batch["token_level_rewards"] = rewards
            part.batch["advantages"] = ppo_math.advantages(rewards, mask, [self.batch.uid[i] for i in rows], s)
            part = self._old_log_probs(part, None if pi_old is None else pi_old[rows], self.batch.corrected[rows])
            totals = self._update(part)
            metrics = ppo_math.step_record(
                totals, step=number, samples=len(rows), response_mask=mask, kl=kl,
                scores=part.batch["token_level_scores"], epochs=s.ppo_epochs,
                elapsed_s=time.perf_counter() - started, meta=self.batch.meta,
            )
            steps.append(metrics)
            self.record(metrics)
        return steps

    def _old_log_probs(self, part: Any, pi_old: Any, corrected: Any) -> Any:
        """verl's own mechanisms: bypass mode sets old = rollout (captured) logprobs; decoupled mode keeps π_old
        and adds token-level truncated IS weights against the captured behaviour logprobs. A bypass run with
        constrained rows (`mixed`) decouples those rows only, with the local trainer's rule."""
        from verl.trainer.config import RolloutCorrectionConfig
        from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode, compute_rollout_correction_and_add_to_batch

        from .. import ppo_math

        rc = self.cfg.algorithm.rollout_correction
        if pi_old is None:
            apply_bypass_mode(part, rollout_corr_config=rc, policy_loss_config=self.cfg.actor_rollout_ref.actor.policy_loss)
        elif self.mixed:
            old, weights = ppo_math.behaviour_correction(part.batch["rollout_log_probs"], pi_old, corrected,
                                                         self.settings)
            part.batch["old_log_probs"] = old
            if weights is not None:  # None: no constrained row in this slice, which trains as in bypass mode
                part.batch["rollout_is_weights"] = weights
        else:
            part.batch["old_log_probs"] = pi_old
            from omegaconf import OmegaConf

            rc_fields = OmegaConf.to_container(rc, resolve=True)
            rc_fields.pop("_target_", None)
            part, _ = compute_rollout_correction_and_add_to_batch(part, RolloutCorrectionConfig(**rc_fields))
        if not self.loss_ready:
            self._set_loss()
        return part

    def _set_loss(self) -> None:
        # After apply_bypass_mode: it switches the policy loss to verl's bypass_mode loss in the config.
        from functools import partial

        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.utils.losses import ppo_loss

        actor_config = omega_conf_to_dataclass(self.cfg.actor_rollout_ref.actor)
        self.worker.set_loss_fn(partial(ppo_loss, config=actor_config))
        self.loss_ready = True

    def _infer(self, *, no_adapter: bool) -> Any:
        """Per-token logprobs of every response token under the current (or, adapter disabled, base) weights.
        Every rank runs the whole batch: FSDP forwards are collective."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

        td = left_right_2_no_padding(self.data.to_tensordict())  # its `temperature` tensor: one per row
        meta: dict[str, Any] = {"calculate_entropy": False, "compute_loss": False}
        engine = self.worker.engine_config
        if not engine.use_dynamic_bsz:
            meta["micro_batch_size_per_gpu"] = micro_batch_size(len(self.data), engine.infer_micro_batch_size_per_gpu)
        if no_adapter:
            meta["no_lora_adapter"] = True
        tu.assign_non_tensor(td, **meta)
        out = self.worker.infer_batch(td)
        return no_padding_2_padding(tu.get(out, "log_probs"), td).float().cpu()

    def _update(self, part: Any) -> dict[str, float]:
        """One optimizer step per mini-batch of the slice (verl's train_mini_batch), `ppo_epochs` times."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        s = self.settings
        mini = max(1, s.ppo_mini_batch_size)
        keep = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "old_log_probs",
                "advantages", "rollout_is_weights", "prompts", "temperature")
        sums: dict[str, float] = {}
        count = 0
        for _ in range(s.ppo_epochs):
            for start in range(0, len(part), mini):
                piece = part.select_idxs(list(range(start, min(start + mini, len(part)))))
                piece = shard_rows(piece, self.rank, self.world_size)
                piece = piece.select(batch_keys=[k for k in keep if k in piece.batch.keys()])
                td = left_right_2_no_padding(piece.to_tensordict())
                size = len(piece) * self.world_size
                tu.assign_non_tensor(
                    td, calculate_entropy=bool(s.entropy_coeff), global_batch_size=size, mini_batch_size=size,
                    epochs=1, seed=s.seed, dataloader_kwargs={"shuffle": False}, compute_loss=True,
                )
                engine = self.worker.engine_config
                if not engine.use_dynamic_bsz:
                    tu.assign_non_tensor(td, micro_batch_size_per_gpu=micro_batch_size(len(piece), engine.micro_batch_size_per_gpu))
                out = tu.get(self.worker.train_mini_batch(td), "metrics")
                for ours, theirs in (("loss", "loss"), ("pg_loss", "actor/pg_loss"),
                                     ("clip_fraction", "actor/pg_clipfrac"), ("ppo_kl", "actor/ppo_kl"),
                                     ("entropy", "actor/entropy_loss"), ("grad_norm", "grad_norm")):
                    if theirs in out:
                        sums[ours] = sums.get(ours, 0.0) + _mean(out[theirs])
                count += 1
        return {k: v / max(1, count) for k, v in sums.items()}


def micro_batch_size(rows: int, configured: int | None) -> int:
    """verl splits a batch into equal micro-batches: the largest size ≤ the configured one that divides `rows`
    (a last partial slice of `ppo_samples_per_step`, or a small batch, is trained rather than refused)."""
    limit = max(1, min(rows, configured or rows))
    return max(d for d in range(1, limit + 1) if rows % d == 0)


def _mean(value: Any) -> float:
    values = value if isinstance(value, (list, tuple)) else [value]
    floats = [float(getattr(v, "value", v)) for v in values]
    return sum(floats) / len(floats) if floats else 0.0


def shard_rows(piece: Any, rank: int, world_size: int) -> Any:
    """This rank's rows of a mini-batch. With several ranks a mini-batch whose size does not divide is first
    padded with copies of its last row that keep one response token with advantage 0: no policy-gradient
    contribution (verl refuses micro-batches without any valid token); they add one token to the token-mean's
    denominator and to the entropy bonus. Mini-batch sizes that are multiples of `nproc_per_node` avoid it."""
    if world_size == 1:
        return piece
    import torch
    from verl import DataProto

    missing = (-len(piece)) % world_size
    if missing:
        filler = piece.select_idxs([len(piece) - 1] * missing)
        mask = torch.zeros_like(filler.batch["response_mask"])
        mask[:, 0] = 1
        filler.batch["response_mask"] = mask
        if "advantages" in filler.batch.keys():
            filler.batch["advantages"] = torch.zeros_like(filler.batch["advantages"])
        piece = DataProto.concat([piece, filler])
    per = len(piece) // world_size
    return piece.select_idxs(list(range(rank * per, (rank + 1) * per)))


def export_adapter(worker: Any, out_dir: Path) -> dict[str, bytes]:
    """The trained LoRA in PEFT format (what vLLM's /v1/load_lora_adapter reads). Gathering the full state dict
    is collective, so every rank calls this; rank 0 gets the tensors and writes the files."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = worker.engine.module
    with worker.engine.eval_mode():  # brings offloaded parameters back to the device for the gather
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return {}
    save_peft_adapter(getattr(module, "_fsdp_wrapped_module", module), out_dir, state_dict=state)
    return {name: (out_dir / name).read_bytes() for name in ADAPTER_FILES}
