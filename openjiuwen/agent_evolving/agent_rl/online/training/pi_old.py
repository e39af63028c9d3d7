"""Which rows of a run get π_old (the parent weights' logprobs, before the first update) from a forward pass
(issue 38 item 4; docs/training.md "The mismatch report").

π_old enters the loss of a decoupled row only: every row under `tis_cap`, else the constrained rows
(ppo_math.behaviour_correction). The other rows train in bypass mode and never read it, so computing it for all of
them (what the trainer did after issue 29) doubled a run's time for the sampling report alone. A run now forwards:

- the rows whose loss reads π_old, except the ones whose captured logprobs ARE π_old: drawn by the run's parent
  version, not truncated, not constrained, not greedy (their captured logprob is the policy's at the row's own
  temperature, vLLM's `processed_logprobs`, proven on a real vLLM by issue 29);
- a seeded sample of `sampling_report_rows` rows for the report (captured against recomputed).

Reuse is checked against the sample: when a reusable row of the sample differs from its captured logprobs by more
than `REUSE_TOLERANCE` (a vLLM in `raw_logprobs` mode, another precision), the premise does not hold on this
deployment and every reusable row is forwarded too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import ConvertedBatch
from .ppo_settings import PPOSettings

# Largest |captured − recomputed| (nats) on a reusable row at which its captured logprobs stand for π_old: its TIS
# weight min(exp(gap), cap) is then within 1 % of the 1 that reuse gives it, and the old logprob within 0.01 of
# PPO's clip range edges (0.2).
REUSE_TOLERANCE = 0.01


@dataclass(frozen=True)
class PiOldPlan:
    report: torch.Tensor  # [B] bool: the report's sample
    needed: torch.Tensor  # [B] bool: rows whose loss reads π_old
    reusable: torch.Tensor  # [B] bool: needed rows whose captured logprobs are π_old

    def forwarded(self) -> torch.Tensor:
        """The rows a first forward pass computes: the sample, and the needed rows that cannot reuse."""
        return self.report | (self.needed & ~self.reusable)


def reusable_rows(batch: ConvertedBatch, parent_version: str) -> torch.Tensor:
    """[B] bool: rows drawn by `parent_version` at the temperature they train at, with nothing cutting or shaping
    the distribution: their captured logprobs are the parent weights' own."""
    drawn_by_parent = torch.tensor([v == parent_version for v in batch.policy_versions], dtype=torch.bool)
    return drawn_by_parent & ~batch.truncated & ~batch.corrected & ~batch.greedy


def report_sample(rows: int, count: int, seed: int) -> torch.Tensor:
    """[rows] bool: `count` rows drawn without replacement, the same for the same seed (all rows when count ≥ rows)."""
    chosen = torch.zeros(rows, dtype=torch.bool)
    if count >= rows:
        chosen[:] = True
    elif count > 0:
        chosen[torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:count]] = True
    return chosen


def plan(batch: ConvertedBatch, settings: PPOSettings, parent_version: str) -> PiOldPlan:
    rows = len(batch)
    needed = torch.ones(rows, dtype=torch.bool) if settings.tis_cap else batch.corrected.clone()
    reusable = needed & reusable_rows(batch, parent_version)
    return PiOldPlan(report=report_sample(rows, settings.sampling_report_rows, settings.seed), needed=needed,
                     reusable=reusable)


def reuse_holds(batch: ConvertedBatch, plan_: PiOldPlan, recomputed: torch.Tensor) -> bool:
    """Whether every reusable row of the report's sample has its captured logprobs within `REUSE_TOLERANCE` of the
    recomputed ones (vacuously true without such a row)."""
    checked = plan_.reusable & plan_.report
    if not bool(checked.any()):
        return True
    mask = batch.response_mask[checked] > 0
    gap = (batch.old_log_probs[checked] - recomputed[checked]).abs()[mask]
    return gap.numel() == 0 or float(gap.max()) <= REUSE_TOLERANCE
