"""Which lines the scheduler trains next: a pure function over a snapshot (no I/O, no clock), so every rule of
automatic training is unit-tested on its own (tests/unit/test_training_eligibility.py).

A line is eligible when automatic training is on, the line is not paused, it has no active run and no canary still
deciding, `min_interval_seconds` passed since its previous run ended, and either `min_pending_samples` eligible
samples wait (reason `min_pending_samples`) or its oldest pending sample waited `max_wait_seconds` with at least
`min_batch_on_wait` eligible (reason `max_wait_seconds`). Among eligible lines the one whose oldest sample waited
longest goes first, and no more start than `max_concurrent_runs` minus the runs already active.

Each line is judged under its lineage's policy (`training_policy.lineages.<name>` merged over the top level,
`TrainingPolicyConfig.for_lineage`); `max_concurrent_runs` is machine-wide, the top level's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .policy import TrainingPolicyConfig

MIN_PENDING, MAX_WAIT = "min_pending_samples", "max_wait_seconds"
# Why a line is not eligible now, in the order checked.
AUTO_OFF, PAUSED, RUN_ACTIVE, ROLLOUT_DECIDING, INTERVAL, NO_SAMPLES, TOO_FEW, WAITING = (
    "auto_off", "paused", "run_active", "rollout_deciding", "min_interval", "no_samples", "below_floor",
    "waiting")


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


@dataclass(frozen=True, slots=True)
class Verdict:
    line: str
    eligible: bool
    reason: str  # MIN_PENDING / MAX_WAIT when eligible, else why not
    min_samples: int  # the smallest batch this start may claim
    oldest_wait_s: float | None
    next_eligible_at: float | None  # epoch the line becomes eligible if nothing else changes, when known


def judge_line(state: LineState, top: TrainingPolicyConfig, now: float) -> Verdict:
    policy = top.for_lineage(state.lineage)
    wait = None if state.oldest_at is None else max(0.0, now - state.oldest_at)

    def no(reason: str, at: float | None = None) -> Verdict:
        return Verdict(state.line, False, reason, policy.min_pending_samples, wait, at)

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
    if state.eligible <= 0 or state.oldest_at is None:
        return no(NO_SAMPLES)
    if state.eligible >= policy.min_pending_samples:
        return Verdict(state.line, True, MIN_PENDING, policy.min_pending_samples, wait, now)
    if policy.max_wait_seconds is None or state.eligible < policy.min_batch_on_wait:
        return no(TOO_FEW)
    due = state.oldest_at + policy.max_wait_seconds
    if now >= due:
        return Verdict(state.line, True, MAX_WAIT, policy.min_batch_on_wait, wait, now)
    return no(WAITING, due)


def choose(
    states: Iterable[LineState], policy: TrainingPolicyConfig, now: float, *, active_runs: int
) -> list[Verdict]:
    """The lines to start now, longest-waiting first, at most `max_concurrent_runs - active_runs` of them."""
    room = policy.max_concurrent_runs - active_runs
    if room <= 0:
        return []
    return rank(states, policy, now)[:room]


def rank(states: Iterable[LineState], policy: TrainingPolicyConfig, now: float) -> list[Verdict]:
    """Every eligible line, longest-waiting first (the scheduler falls through to the next when a start fails)."""
    eligible = [v for v in (judge_line(s, policy, now) for s in states) if v.eligible]
    # Longest wait first; ties by line so the order is total and stable.
    eligible.sort(key=lambda v: (-(v.oldest_wait_s or 0.0), v.line))
    return eligible
