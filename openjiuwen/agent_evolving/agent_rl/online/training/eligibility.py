"""Which lines the scheduler trains next: a pure function over a snapshot (no I/O, no clock), so every rule of
automatic training is unit-tested on its own (tests/unit/test_training_eligibility.py).

A line is eligible when automatic training is on, the line is not paused, it has no active run and no canary still
deciding, `min_interval_seconds` passed since its previous run ended, its `max_runs_per_hour` quota has room, and
either `min_pending_samples` eligible samples wait (reason `min_pending_samples`) or its oldest pending sample waited
`max_wait_seconds` with at least `min_batch_on_wait` eligible (reason `max_wait_seconds`).

Among eligible lines the order is fair share, never backlog: start-time fair queuing over lineages. Each run of a
lineage advances its tag by 1 / its `weight` (written in the claim's EXEC, training/run_claims.py); a line's start tag
is its tag, or the clock (the start tag of the last run started) when that is later, so a lineage that waited idle
holds no credit and one that just became eligible is never behind a busy one. The smallest start tag goes first;
ties (lineages never trained, say) by the longest wait, then by line. So however many runs a flooding lineage has
queued, another lineage that becomes eligible waits for at most the runs already started and one run of each
lineage whose tag is smaller. No more start than `max_concurrent_runs` minus the runs already active.

Each line is judged under its lineage's policy (`training_policy.lineages.<name>` merged over the top level,
`TrainingPolicyConfig.for_lineage`); `max_concurrent_runs` is machine-wide, the top level's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .training_policy import TrainingPolicyConfig

MIN_PENDING, MAX_WAIT = "min_pending_samples", "max_wait_seconds"
# Why a line is not eligible now, in the order checked.
AUTO_OFF, PAUSED, RUN_ACTIVE, ROLLOUT_DECIDING, INTERVAL, QUOTA, NO_SAMPLES, TOO_FEW, WAITING = (
    "auto_off", "paused", "run_active", "rollout_deciding", "min_interval", "max_runs_per_hour", "no_samples",
    "below_floor", "waiting")
HOUR_S = 3600.0


@dataclass(frozen=True, slots=True)
class LineState:
    """What the scheduler knows of one line at one moment (training/scheduler.py reads it from Redis)."""

    line: str
    lineage: str
    pending: int  # pending samples
    eligible: int  # pending minus those past `max_policy_lag`
    oldest_at: float | None  # epoch of the oldest pending sample, None when none
    last_end_at: float | None  # epoch the line's previous run ended, None when never
    active_run: str | None = None
    rollout_deciding: bool = False
    paused: bool = False
    share_tag: float = 0.0  # its start tag: max(the lineage's fair-share tag, the fair-share clock)
    # Creation epochs of the lineage's latest runs, newest first, at most its `max_runs_per_hour` (read only then).
    recent_starts: tuple[float, ...] = ()
    eligible_since: float | None = None  # when the scheduler first found it eligible (None: not eligible then)
    policy_version: int = 0  # N of the line's active version as last observed (0 = base): what lag is counted from


@dataclass(frozen=True, slots=True)
class Verdict:
    line: str
    eligible: bool
    reason: str  # MIN_PENDING / MAX_WAIT when eligible, else why not
    min_samples: int  # the smallest batch this start may claim
    oldest_wait_s: float | None
    next_eligible_at: float | None  # epoch the line becomes eligible if nothing else changes, when known
    share_tag: float = 0.0


def quota_free_at(starts: tuple[float, ...], limit: int | None, now: float) -> float | None:
    """When a `limit` runs-per-hour quota has room again, given the newest starts first; None when it has room."""
    if limit is None or len(starts) < limit:
        return None
    free_at = starts[limit - 1] + HOUR_S  # the limit-th newest start leaves the hour then
    return free_at if free_at > now else None


def judge_line(state: LineState, top: TrainingPolicyConfig, now: float) -> Verdict:
    policy = top.for_lineage(state.lineage)
    wait = None if state.oldest_at is None else max(0.0, now - state.oldest_at)

    def no(reason: str, at: float | None = None) -> Verdict:
        return Verdict(state.line, False, reason, policy.min_pending_samples, wait, at, state.share_tag)

    def yes(reason: str, min_samples: int) -> Verdict:
        return Verdict(state.line, True, reason, min_samples, wait, now, state.share_tag)

    if not policy.auto:
        return no(AUTO_OFF)
    if state.paused:
        return no(PAUSED)
    if state.active_run is not None:
        return no(RUN_ACTIVE)
    if state.rollout_deciding:
        return no(ROLLOUT_DECIDING)
    if state.last_end_at is not None and now < state.last_end_at + policy.min_interval_seconds:
        return no(INTERVAL, state.last_end_at + policy.min_interval_seconds)
    if (free_at := quota_free_at(state.recent_starts, policy.max_runs_per_hour, now)) is not None:
        return no(QUOTA, free_at)
    if state.eligible <= 0 or state.oldest_at is None:
        return no(NO_SAMPLES)
    if state.eligible >= policy.min_pending_samples:
        return yes(MIN_PENDING, policy.min_pending_samples)
    if policy.max_wait_seconds is None or state.eligible < policy.min_batch_on_wait:
        return no(TOO_FEW)
    due = state.oldest_at + policy.max_wait_seconds
    if now >= due:
        return yes(MAX_WAIT, policy.min_batch_on_wait)
    return no(WAITING, due)


def choose(
    states: Iterable[LineState], policy: TrainingPolicyConfig, now: float, *, active_runs: int
) -> list[Verdict]:
    """The lines to start now, in fair-share order, at most `max_concurrent_runs - active_runs` of them."""
    room = policy.max_concurrent_runs - active_runs
    if room <= 0:
        return []
    return rank(states, policy, now)[:room]


def rank(states: Iterable[LineState], policy: TrainingPolicyConfig, now: float) -> list[Verdict]:
    """Every eligible line in fair-share order (the scheduler falls through to the next when a start fails)."""
    eligible = [v for v in (judge_line(s, policy, now) for s in states) if v.eligible]
    # The smallest start tag first; then the longest wait; then the line, so the order is total and stable.
    eligible.sort(key=lambda v: (v.share_tag, -(v.oldest_wait_s or 0.0), v.line))
    return eligible
