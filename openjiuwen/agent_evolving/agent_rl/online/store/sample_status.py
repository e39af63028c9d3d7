"""The status of a stored sample and the moves between statuses (CONTRACT §5.2, docs/rewards.md, docs/concepts.md).

The values are what Redis holds (hash field `status`, the `traj_idx:{owner}:{status}` indexes, the `status:<s>`
counters) and what the API shows, so they never change. A sample waits in `awaiting_rewards` (before `pending`) only
under a reward policy; a sample of an evaluation Task enters `evaluation` at publication and leaves it only by
retention; a sample served by an instance an operator excluded is `excluded` (at publication, by the exclusion, or
when the run that held it gives it back) and never reaches a Training Run; a pending sample whose policy lags its
line's past `max_policy_lag` becomes `outdated` and never reaches one either. Insertion and deletion are not moves:
`SampleLine.queue_move` checks every move against the table.
"""

from __future__ import annotations

from enum import StrEnum

from ..transitions import Transitions


class SampleStatus(StrEnum):
    AWAITING_REWARDS = "awaiting_rewards"
    PENDING = "pending"
    TRAINING = "training"
    TRAINED = "trained"
    FAILED = "failed"
    EVALUATION = "evaluation"
    EXCLUDED = "excluded"
    # Its policy lags its line's active policy by more than `max_policy_lag`: it left `pending` so that it no longer
    # holds its line's place in automatic training (training/scheduler.py); never trained, swept by retention.
    OUTDATED = "outdated"


# Every status, in listing order (buckets of `GET /v1/rl/trajectories`).
ALL_SAMPLE_STATUSES: tuple[SampleStatus, ...] = tuple(SampleStatus)
# The statuses every store shows in its stats (CONTRACT §2.7); the others appear only when in use.
SAMPLE_STATUSES = (SampleStatus.PENDING, SampleStatus.TRAINING, SampleStatus.TRAINED, SampleStatus.FAILED)

SAMPLE_TRANSITIONS = Transitions("sample", {
    # Its last open reward source arrived or fell back; or an operator excluded the instance that served it.
    SampleStatus.AWAITING_REWARDS: {SampleStatus.PENDING, SampleStatus.EXCLUDED},
    # Claimed by a Training Run, excluded, or outdated (its policy lags its line's past `max_policy_lag`).
    SampleStatus.PENDING: {SampleStatus.TRAINING, SampleStatus.EXCLUDED, SampleStatus.OUTDATED},
    # The run's outcome; back to `pending` when the run is canceled, failed or vanished before training ended
    # (`excluded` instead when its instance was excluded meanwhile).
    SampleStatus.TRAINING: {SampleStatus.TRAINED, SampleStatus.FAILED, SampleStatus.PENDING, SampleStatus.EXCLUDED},
    SampleStatus.TRAINED: set(),
    SampleStatus.FAILED: set(),
    SampleStatus.EVALUATION: set(),
    SampleStatus.EXCLUDED: set(),
    SampleStatus.OUTDATED: set(),
})
