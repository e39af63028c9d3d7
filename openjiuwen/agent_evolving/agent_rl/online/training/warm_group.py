"""Several lineages' PPO runs trained together, one step at a time, in the warm trainer (warm_worker.py).

Each lineage keeps its own `ppo_update.PPOUpdate`: its converted batch, its reference and π_old log-probs, its
rewards, advantages and AdamW optimizer over its own adapter's parameters. A group step runs, for every micro-batch
position, each lineage's micro-batch through its own adapter (adapter_routing.AdapterView), sums the lineages' scaled
losses and calls backward once; then each lineage clips its own gradient norm and steps its own optimizer. The
adapters share no parameter, so the gradient of the sum with respect to A's adapter is the gradient of A's loss: A
trains as it would alone, and B's rows never reach A's weights (tests/learning/test_warm_trainer.py).

A group of one calls the per-run code unchanged (`PPOUpdate.step`). The math below mirrors `PPOUpdate.step` and
`PPOUpdate._update` for several updates at once; a change there must be made here too (the equivalence test fails
otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LineageRun:
    """One run of the group: its id, its PPO state and the slices (PPO steps) still to train."""

    run_id: str
    update: Any  # ppo_update.PPOUpdate over an AdapterView
    slices: list[list[int]]
    step_metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.slices)


@dataclass
class _Prepared:
    run: LineageRun
    rows: list[int]
    old: Any
    adv: Any
    mask: Any
    weights: Any
    kl: Any
    idx: Any
    totals: dict[str, float] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    micro_count: int = 0


def train_together(runs: list[LineageRun], *, emit_step: Callable[[LineageRun, dict[str, Any]], None],
                   canceled: Callable[[str], bool], before_backward: Callable[[], None] = lambda: None) -> list[str]:
    """Train every run's slices, step k of all runs together; the ids of the runs dropped because `canceled` said so
    (checked before each step: a canceled run stops there, the others go on)."""
    dropped: list[str] = []
    live = list(runs)
    step = 0
    while True:
        step += 1
        for run in [r for r in live if canceled(r.run_id)]:
            live.remove(run)
            dropped.append(run.run_id)
        live = [r for r in live if r.steps >= step]
        if not live:
            return dropped
        if len(live) == 1:
            run = live[0]
            metrics = run.update.step(step, run.slices[step - 1])
            run.step_metrics.append(metrics)
            emit_step(run, metrics)
            continue
        started = time.perf_counter()
        prepared = [_prepare(run, run.slices[step - 1]) for run in live]
        _update_together(prepared, before_backward)
        elapsed = time.perf_counter() - started
        for p in prepared:
            metrics = _record(p, step, elapsed, len(prepared))
            p.run.step_metrics.append(metrics)
            emit_step(p.run, metrics)


def _prepare(run: LineageRun, rows: list[int]) -> _Prepared:
    """The slice's rewards, advantages and behaviour correction, as `PPOUpdate.step` computes them."""
    import torch

    from . import ppo_math

    u = run.update
    batch, settings = u._batch, u._settings
    idx = torch.tensor(rows, dtype=torch.long)
    behaviour = batch.old_log_probs[idx]
    slice_mask = batch.response_mask[idx]
    ref = None if u._ref_log_probs is None else u._ref_log_probs[idx]
    rewards, kl = ppo_math.token_level_rewards(
        batch.token_level_scores[idx], slice_mask, behaviour_log_probs=behaviour, ref_log_probs=ref, settings=settings,
    )
    adv = ppo_math.advantages(rewards, slice_mask, [batch.uid[i] for i in rows], settings)
    old, weights = ppo_math.behaviour_correction(
        behaviour, None if u._pi_old is None else u._pi_old[idx], batch.corrected[idx], settings)
    return _Prepared(run, rows, old, adv, slice_mask, weights, kl, idx)


def _micro_plan(p: _Prepared) -> list[list[list[int]]]:
    """The run's mini-batches of one epoch, each a list of micro-batches of positions in its slice."""
    settings = p.run.update._settings
    mini = max(1, settings.ppo_mini_batch_size)
    micro = max(1, settings.ppo_micro_batch_size)
    plan = []
    for m_start in range(0, len(p.rows), mini):
        mini_rows = list(range(m_start, min(m_start + mini, len(p.rows))))
        plan.append([mini_rows[u : u + micro] for u in range(0, len(mini_rows), micro)])
    return plan


def _update_together(prepared: list[_Prepared], before_backward: Callable[[], None]) -> None:
    """`ppo_epochs` passes; at each (epoch, mini-batch, micro-batch) position, one backward over the summed losses of
    every run that has that position; then each run's own clip and optimizer step at the end of its mini-batch."""
    import torch

    from . import ppo_math

    plans = [_micro_plan(p) for p in prepared]
    epochs = max(p.run.update._settings.ppo_epochs for p in prepared)
    for p in prepared:
        p.run.update._model.train()
    for epoch in range(epochs):
        members = [i for i, p in enumerate(prepared) if epoch < p.run.update._settings.ppo_epochs]
        for m in range(max(len(plans[i]) for i in members)):
            in_mini = [i for i in members if m < len(plans[i])]
            prefixes = {}
            for i in in_mini:
                prepared[i].run.update._optimizer.zero_grad(set_to_none=True)
                prefixes[i] = ppo_math.SharedPrefix()  # per run (its own adapter), valid until its optimizer step
            for micro_at in range(max(len(plans[i][m]) for i in in_mini)):
                losses = []
                for i in in_mini:
                    if micro_at >= len(plans[i][m]):
                        continue
                    p = prepared[i]
                    u = p.run.update
                    local = plans[i][m][micro_at]
                    mini_len = sum(len(mb) for mb in plans[i][m])
                    stats = u._forward([p.rows[j] for j in local], grad=True, prefix=prefixes[i],
                                       entropy=bool(u._settings.entropy_coeff))
                    loc = torch.tensor(local, dtype=torch.long)
                    loss, parts = ppo_math.policy_loss(
                        old_log_probs=p.old[loc], log_probs=stats.log_probs, adv=p.adv[loc],
                        response_mask=p.mask[loc], entropy=stats.entropy,
                        is_weights=None if p.weights is None else p.weights[loc], actor=u._actor, settings=u._settings,
                    )
                    losses.append(loss * (len(local) / mini_len))
                    parts["loss"] = float(loss.detach())
                    for key, value in parts.items():
                        p.totals[key] = p.totals.get(key, 0.0) + value
                    p.micro_count += 1
                before_backward()
                torch.stack(losses).sum().backward()  # one backward; each adapter gets only its own loss's gradient
            for i in in_mini:
                u = prepared[i].run.update
                grad_norm = torch.nn.utils.clip_grad_norm_(u._trainable(), u._settings.grad_clip)
                prepared[i].grad_norms.append(float(grad_norm))
                u._optimizer.step()


def _record(p: _Prepared, step: int, elapsed: float, group: int) -> dict[str, Any]:
    from . import ppo_math

    u = p.run.update
    totals = {key: value / max(1, p.micro_count) for key, value in p.totals.items()}
    totals["grad_norm"] = sum(p.grad_norms) / max(1, len(p.grad_norms))
    record = ppo_math.step_record(
        totals, step=step, samples=len(p.rows), response_mask=p.mask, kl=p.kl,
        scores=u._batch.token_level_scores[p.idx], epochs=u._settings.ppo_epochs, elapsed_s=elapsed,
        meta=u._batch.meta,
    )
    record["trained_with"] = group  # lineages in this step's shared backward (its seconds are the group's)
    return record
