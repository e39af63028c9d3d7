"""One Training Run's PPO update on a loaded policy and a converted batch: the log-probs fixed before any update
(KL reference, π_old where needed, the sampling report), then one PPO step per slice. The local trainer process
(local_worker.py) drives it; it holds no process or file handling, so another driver can reuse it.

Loaded only inside trainer processes (torch, peft and verl are heavy).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from . import pi_old as pi_old_rows
from . import ppo_math
from .batch import ConvertedBatch, chunk_rows
from .ppo_settings import PPOSettings


class PPOUpdate:
    """One run's PPO state: the policy and its optimizer, the converted batch, and the log-probs fixed before any
    update, each row at its sample's temperature: the frozen base model as KL reference, and π_old with the parent
    weights for the rows the loss reads it from (every row under `tis_cap`, the constrained rows otherwise:
    ppo_math.behaviour_correction) and for the sampling report's sample (pi_old.py)."""

    def __init__(self, model: Any, batch: ConvertedBatch, settings: PPOSettings) -> None:
        self._model = model
        self._batch = batch
        self._settings = settings
        self._actor = ppo_math.actor_config(settings)
        self._ref_log_probs: torch.Tensor | None = None
        self._pi_old: torch.Tensor | None = None
        self.sampling: dict[str, Any] = {}
        self._optimizer = torch.optim.AdamW(self._trainable(), lr=settings.learning_rate, weight_decay=0.01)

    def fix_log_probs(self, parent_version: str) -> None:
        """Before the first update: the KL reference (when the reward has a KL term), π_old of the rows that need
        it and the sampling report. `parent_version` is the policy the run starts from (reuse: pi_old.py)."""
        batch, settings = self._batch, self._settings
        if settings.use_kl_in_reward and settings.kl_coef > 0:
            self._ref_log_probs = self.forward_rows(range(len(batch)), disable_adapter=True)
        plan = pi_old_rows.plan(batch, settings, parent_version)
        forwarded = plan.forwarded()
        pi_old = batch.old_log_probs.clone()  # reused rows: the captured logprobs are π_old
        self._fill(pi_old, forwarded)
        reused = plan.reusable & ~forwarded
        if bool(reused.any()) and not pi_old_rows.reuse_holds(batch, plan, pi_old):
            self._fill(pi_old, reused)  # the sample refuted the premise: compute them all
            forwarded, reused = forwarded | reused, torch.zeros_like(reused)
        if bool(plan.needed.any()):
            self._pi_old = pi_old
        self.sampling = ppo_math.sampling_report(
            captured=batch.old_log_probs, recomputed=pi_old, response_mask=batch.response_mask,
            temperatures=batch.temperatures, truncated=batch.truncated, settings=settings, corrected=batch.corrected,
            measured=forwarded,
        )
        self.sampling["pi_old_reused_samples"] = int(reused.sum())

    def _fill(self, pi_old: torch.Tensor, rows: torch.Tensor) -> None:
        picked = torch.nonzero(rows).view(-1).tolist()
        if picked:
            pi_old[picked] = self.forward_rows(picked)

    def _trainable(self) -> list[Any]:
        return [p for p in self._model.parameters() if p.requires_grad]

    def slices(self) -> list[list[int]]:
        batch = self._batch
        grpo = self._settings.advantage_estimator == "grpo"  # a group is never split across steps
        return chunk_rows(
            len(batch), self._settings.ppo_samples_per_step, uids=batch.uid if grpo else None,
            created_at=batch.created_at if grpo else None,
        )

    def _forward(self, rows: list[int], *, grad: bool, prefix: ppo_math.SharedPrefix,
                 entropy: bool = False) -> ppo_math.TokenStats:
        batch = self._batch
        idx = torch.tensor(rows, dtype=torch.long)
        with torch.set_grad_enabled(grad):
            # `detach_prompt` in the passes without autograd too: the same prompt-cache path as the update's
            # forward (same numerics), and the shared prefix run once per micro-batch instead of per row.
            return ppo_math.response_log_probs(
                self._model, batch.input_ids[idx], batch.attention_mask[idx], batch.position_ids[idx],
                batch.responses[idx], batch.temperatures[idx], with_entropy=entropy,
                detach_prompt=self._settings.detach_prompt, prefix=prefix,
            )

    def forward_rows(self, rows: Any, *, disable_adapter: bool = False) -> torch.Tensor:
        """Log-probs [len(rows), R] of the batch rows `rows` with the current weights (or the frozen base), in
        micro-batches, without autograd."""
        rows = list(rows)
        micro = max(1, self._settings.ppo_micro_batch_size)
        parts = []
        prefix = ppo_math.SharedPrefix()  # the weights stay as they are for the whole pass
        self._model.eval()
        for start in range(0, len(rows), micro):
            chunk = rows[start : start + micro]
            if disable_adapter:
                with self._model.disable_adapter():
                    parts.append(self._forward(chunk, grad=False, prefix=prefix).log_probs)
            else:
                parts.append(self._forward(chunk, grad=False, prefix=prefix).log_probs)
        return torch.cat(parts).detach()

    def step(self, step: int, rows: list[int]) -> dict[str, Any]:
        """One PPO step over the batch rows `rows`: rewards and advantages of the slice, then the update; its
        metrics record."""
        batch, settings = self._batch, self._settings
        started = time.perf_counter()
        idx = torch.tensor(rows, dtype=torch.long)
        behaviour = batch.old_log_probs[idx]
        slice_mask = batch.response_mask[idx]
        ref = None if self._ref_log_probs is None else self._ref_log_probs[idx]
        rewards, kl = ppo_math.token_level_rewards(
            batch.token_level_scores[idx], slice_mask, behaviour_log_probs=behaviour, ref_log_probs=ref,
            settings=settings,
        )
        adv = ppo_math.advantages(rewards, slice_mask, [batch.uid[i] for i in rows], settings)
        old, weights = ppo_math.behaviour_correction(
            behaviour, None if self._pi_old is None else self._pi_old[idx], batch.corrected[idx], settings)
        totals = self._update(rows, old=old, adv=adv, mask=slice_mask, weights=weights)
        elapsed = time.perf_counter() - started
        return ppo_math.step_record(
            totals, step=step, samples=len(rows), response_mask=slice_mask, kl=kl,
            scores=batch.token_level_scores[idx], epochs=settings.ppo_epochs, elapsed_s=elapsed, meta=batch.meta,
        )

    def _update(self, rows: list[int], *, old: Any, adv: Any, mask: Any, weights: Any) -> dict[str, float]:
        """`ppo_epochs` passes over the slice in mini-batches (one optimizer step each) of micro-batches (one
        backward each); the loss parts averaged over the micro-batches, and the mean gradient norm."""
        settings = self._settings
        self._model.train()
        totals: dict[str, float] = {}
        grad_norms: list[float] = []
        micro_count = 0
        mini = max(1, settings.ppo_mini_batch_size)
        micro = max(1, settings.ppo_micro_batch_size)
        for _ in range(settings.ppo_epochs):
            for m_start in range(0, len(rows), mini):
                mini_rows = list(range(m_start, min(m_start + mini, len(rows))))
                self._optimizer.zero_grad(set_to_none=True)
                prefix = ppo_math.SharedPrefix()  # valid until this mini-batch's optimizer step
                for u_start in range(0, len(mini_rows), micro):
                    local = mini_rows[u_start : u_start + micro]
                    stats = self._forward([rows[i] for i in local], grad=True, prefix=prefix,
                                          entropy=bool(settings.entropy_coeff))
                    loc = torch.tensor(local, dtype=torch.long)
                    loss, parts = ppo_math.policy_loss(
                        old_log_probs=old[loc], log_probs=stats.log_probs, adv=adv[loc],
                        response_mask=mask[loc], entropy=stats.entropy,
                        is_weights=None if weights is None else weights[loc], actor=self._actor, settings=settings,
                    )
                    (loss * (len(local) / len(mini_rows))).backward()
                    parts["loss"] = float(loss.detach())
                    for key, value in parts.items():
                        totals[key] = totals.get(key, 0.0) + value
                    micro_count += 1
                grad_norm = torch.nn.utils.clip_grad_norm_(self._trainable(), settings.grad_clip)
                grad_norms.append(float(grad_norm))
                self._optimizer.step()
        totals = {key: value / max(1, micro_count) for key, value in totals.items()}
        totals["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
        return totals

    def run_record(self, step_metrics: list[dict[str, Any]]) -> dict[str, Any]:
        return ppo_math.run_record(step_metrics, self._batch.meta, self.sampling)
