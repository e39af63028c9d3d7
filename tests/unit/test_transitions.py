"""The state-machine tables: a legal move passes, a forbidden one raises IllegalTransition (never an assert)."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.online.store.sample_status import SAMPLE_TRANSITIONS, SampleStatus
from openjiuwen.agent_evolving.agent_rl.common.wire.task_states import (
    ENDED_TASK_STATUSES, FinishReason, RewardMode, TaskStatus,
)
from openjiuwen.agent_evolving.agent_rl.online.tasks.task_records import (
    TASK_TRANSITIONS, TERMINAL_REWARD_TRANSITIONS, TURN_PUBLICATION_TRANSITIONS, Task, TerminalReward, TurnPublication,
)
from openjiuwen.agent_evolving.agent_rl.online.training.run_records import (
    RUN_STAGE_TRANSITIONS, RUN_TRANSITIONS, TERMINAL_STATUSES, RunStage, RunStatus, TrainingRun, new_run_id,
)
from openjiuwen.agent_evolving.agent_rl.online.transitions import IllegalTransition


def task(status: TaskStatus) -> Task:
    return Task("t1", "s1", "m", "base", RewardMode.TERMINAL, status.value, "2026-01-01T00:00:00+00:00")


def run(status: RunStatus, stage: RunStage) -> TrainingRun:
    return TrainingRun(new_run_id(), status.value, stage.value, 0, {}, "2026-01-01T00:00:00+00:00")


@pytest.mark.parametrize("target", [TaskStatus.FINALIZED, TaskStatus.ABORTED])
def test_an_active_task_ends(target):
    done = task(TaskStatus.ACTIVE).terminal(target, FinishReason.USER_STOPPED, "2026-01-01T00:00:01+00:00")
    assert (done.status, done.finish_reason) == (target, "user_stopped")


@pytest.mark.parametrize("ended", [TaskStatus.FINALIZED, TaskStatus.ABORTED])
@pytest.mark.parametrize("target", [TaskStatus.FINALIZED, TaskStatus.ABORTED, TaskStatus.ACTIVE])
def test_an_ended_task_never_moves(ended, target):
    with pytest.raises(IllegalTransition) as info:
        task(ended).terminal(target, FinishReason.TIMEOUT, "2026-01-01T00:00:01+00:00")
    assert (info.value.machine, info.value.old, info.value.new) == ("task", ended.value, target.value)
    assert TASK_TRANSITIONS.terminal(ended)


def test_training_run_moves_of_the_runner_are_legal():
    claimed = run(RunStatus.PENDING, RunStage.QUEUED)
    started = claimed.evolve(status=RunStatus.RUNNING.value, stage=RunStage.TRAINING.value)
    trained = started.evolve(stage=RunStage.ACTIVATING.value, lora_name="m:v1")
    assert trained.evolve(status=RunStatus.SUCCEEDED.value).terminal
    for end in (RunStatus.FAILED, RunStatus.CANCELED):
        assert claimed.evolve(status=end.value).terminal  # stopped or restarted before it started
        assert started.evolve(status=end.value).terminal
        assert trained.evolve(status=end.value).terminal
    # A retried transition writes the same values again: no move, no error.
    assert started.evolve(status=RunStatus.RUNNING.value, stage=RunStage.TRAINING.value) == started
    assert claimed.evolve(metrics={"steps": 1}).metrics == {"steps": 1}


@pytest.mark.parametrize("status, stage, changes", [
    (RunStatus.PENDING, RunStage.QUEUED, {"status": RunStatus.SUCCEEDED.value}),
    (RunStatus.SUCCEEDED, RunStage.ACTIVATING, {"status": RunStatus.FAILED.value}),
    (RunStatus.CANCELED, RunStage.TRAINING, {"status": RunStatus.RUNNING.value}),
    (RunStatus.RUNNING, RunStage.TRAINING, {"status": RunStatus.PENDING.value}),
    (RunStatus.RUNNING, RunStage.ACTIVATING, {"stage": RunStage.TRAINING.value}),
    (RunStatus.PENDING, RunStage.QUEUED, {"stage": RunStage.ACTIVATING.value}),
])
def test_training_run_moves_outside_the_table_raise(status, stage, changes):
    with pytest.raises(IllegalTransition):
        run(status, stage).evolve(**changes)


def test_terminal_run_statuses_are_the_ends_of_the_table():
    assert TERMINAL_STATUSES == {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELED}
    assert not RUN_TRANSITIONS.terminal(RunStatus.PENDING) and RUN_STAGE_TRANSITIONS.terminal(RunStage.ACTIVATING)


def test_the_task_ends_the_gateway_knows_are_the_ends_of_the_table():
    # The gateway reads ENDED_TASK_STATUSES (common/wire) to tell a stopped Task; the RL Service's table decides.
    assert ENDED_TASK_STATUSES == {s for s in TaskStatus if TASK_TRANSITIONS.terminal(s)}


@pytest.mark.parametrize("old, new", [
    ("awaiting_rewards", "pending"), ("pending", "training"), ("training", "trained"), ("training", "failed"),
    ("training", "pending"),
])
def test_sample_moves_the_service_makes(old, new):
    assert SAMPLE_TRANSITIONS.check(old, SampleStatus(new)) == new


@pytest.mark.parametrize("old, new", [
    ("evaluation", "pending"), ("trained", "pending"), ("failed", "training"), ("pending", "trained"),
    ("awaiting_rewards", "training"), ("pending", "awaiting_rewards"), ("pending", "bogus"),
])
def test_sample_moves_outside_the_table_raise(old, new):
    with pytest.raises(IllegalTransition):
        SAMPLE_TRANSITIONS.check(old, new)


def test_turn_publication_and_terminal_reward_tables():
    assert TURN_PUBLICATION_TRANSITIONS.allows("publishing", TurnPublication.PUBLISHED)
    assert TURN_PUBLICATION_TRANSITIONS.check("publishing", TurnPublication.FAILED) == "failed"
    with pytest.raises(IllegalTransition):
        TURN_PUBLICATION_TRANSITIONS.check("published", TurnPublication.FAILED)
    assert not TURN_PUBLICATION_TRANSITIONS.allows(None, TurnPublication.PUBLISHED)  # nothing stored: no claim
    assert TERMINAL_REWARD_TRANSITIONS.check("projecting", TerminalReward.PUBLISHED) == "published"
    with pytest.raises(IllegalTransition):
        TERMINAL_REWARD_TRANSITIONS.check("expired", TerminalReward.PUBLISHED)


def test_status_values_stay_those_of_redis_and_the_wire():
    assert [s.value for s in SampleStatus] == [
        "awaiting_rewards", "pending", "training", "trained", "failed", "evaluation", "excluded", "outdated"]
    assert [s.value for s in TurnPublication][:3] == ["publishing", "published", "failed"]
    assert [s.value for s in TerminalReward] == ["projecting", "published", "expired"]


def test_rollout_table_follows_the_canary_and_activation_paths():
    from openjiuwen.agent_evolving.agent_rl.online.rollout.status import (
        ENDED, LIVE, ROLLOUT_TRANSITIONS, RolloutStatus as R,
    )

    for path in ([R.RUNNING, R.PAUSED, R.RUNNING, R.PROMOTING, R.PROMOTED],
                 [R.RUNNING, R.PROMOTING, R.ROLLING_BACK, R.ROLLED_BACK],
                 [R.PAUSED, R.ROLLING_BACK, R.FAILED],
                 [R.ACTIVATING, R.ACTIVATED], [R.ACTIVATING, R.FAILED]):
        for old, new in zip(path, path[1:]):
            assert ROLLOUT_TRANSITIONS.check(old, new) == new
    for old, new in ((R.PROMOTED, R.RUNNING), (R.ROLLED_BACK, R.PROMOTING), (R.RUNNING, R.PROMOTED),
                     (R.ACTIVATING, R.PROMOTED), (R.PROMOTING, R.FAILED), ("running", "nonsense")):
        with pytest.raises(IllegalTransition):
            ROLLOUT_TRANSITIONS.check(old, new)
    assert ENDED == {"promoted", "rolled_back", "activated", "failed"}
    assert LIVE == {"running", "paused", "promoting", "rolling_back", "activating"}

