"""The canary decision rules (docs/rollout.md), on hand-made arms: each rule fires exactly where it should."""

from __future__ import annotations

from openjiuwen.agent_evolving.agent_rl.online.rollout.config import RolloutConfig
from openjiuwen.agent_evolving.agent_rl.online.rollout.decision import Arm, decide

CONFIG = RolloutConfig(mode="canary", min_tasks=5, tolerance=0.05, failure_margin=0.2, max_duration_seconds=100)


def arm(name: str, rewards: list[float], *, failed: int = 0) -> Arm:
    a = Arm(name, tasks=len(rewards) + failed, ended=len(rewards) + failed, failed=failed)
    for r in rewards:
        a.add_reward(r)
    return a


def test_clearly_worse_candidate_is_rolled_back_even_within_tolerance():
    worse = decide(arm("c", [0.2, 0.25, 0.2, 0.22, 0.21]), arm("a", [0.5, 0.52, 0.5, 0.49, 0.51]), CONFIG, 1)
    assert (worse.action, worse.reason) == ("rollback", "regression") and worse.ci95[1] < 0
    # Worse by less than the tolerance but surely worse: still rolled back (a sure regression is never promoted).
    slight = decide(arm("c", [0.48, 0.48, 0.48, 0.48, 0.481]), arm("a", [0.5, 0.5, 0.5, 0.5, 0.501]), CONFIG, 1)
    assert slight.action == "rollback" and -0.05 < slight.reward_delta < 0


def test_not_worse_candidate_is_promoted_and_noise_waits():
    better = decide(arm("c", [0.8, 0.82, 0.78, 0.8, 0.81]), arm("a", [0.5, 0.52, 0.48, 0.5, 0.51]), CONFIG, 1)
    assert (better.action, better.reason) == ("promote", "not_worse") and better.ci95[0] >= -0.05
    noisy = decide(arm("c", [0.0, 1.0, 0.0, 1.0, 0.5]), arm("a", [1.0, 0.0, 1.0, 0.0, 0.5]), CONFIG, 1)
    assert (noisy.action, noisy.reason) == ("wait", "inconclusive")


def test_too_few_rewarded_tasks_wait_then_timeout_follows_the_config():
    few = (arm("c", [0.0, 0.0]), arm("a", [1.0] * 9))
    assert (decide(*few, CONFIG, 1).action, decide(*few, CONFIG, 1).reason) == ("wait", "collecting")
    assert (decide(*few, CONFIG, 100).action, decide(*few, CONFIG, 100).reason) == ("rollback", "timeout")
    waiting = CONFIG.model_copy(update={"on_timeout": "wait"})
    assert decide(*few, waiting, 100).reason == "timeout_waiting"


def test_failure_excess_rolls_back_before_any_reward_rule():
    failing = decide(arm("c", [0.9] * 5, failed=5), arm("a", [0.5] * 9, failed=1), CONFIG, 1)
    assert (failing.action, failing.reason) == ("rollback", "failures")
    within = decide(arm("c", [0.9] * 5, failed=1), arm("a", [0.5] * 9, failed=1), CONFIG, 1)
    assert within.reason != "failures"
    assert failing.arms["candidate"]["failure_share"] == 0.5
