"""The canary decision, a pure function of the two arms' per-Task outcomes (docs/rollout.md).

Each arm counts the Tasks of the canary window pinned to its version: rewarded (a terminal reward published),
failed (aborted), ended (finalized or aborted) and, apart, evaluation Tasks. Rewards are compared with a Welch 95 %
interval of (candidate − active) mean per-Task reward (`policies.welch_delta`, the statistics of
`GET /v1/rl/policies`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..version_report import reward_summary, welch_delta
from .config import RolloutConfig

PROMOTE, ROLLBACK, WAIT = "promote", "rollback", "wait"


@dataclass
class Arm:
    lora_name: str
    tasks: int = 0  # started in the window
    ended: int = 0  # finalized or aborted
    failed: int = 0  # aborted
    evaluation: int = 0  # evaluation Tasks among `tasks` (they count like the others)
    reward_n: int = 0
    reward_sum: float = 0.0
    reward_sq: float = 0.0

    def add_reward(self, value: float) -> None:
        self.reward_n += 1
        self.reward_sum += value
        self.reward_sq += value * value

    @property
    def failure_share(self) -> float | None:
        return self.failed / self.ended if self.ended else None

    def sums(self) -> tuple[int, float, float]:
        return self.reward_n, self.reward_sum, self.reward_sq

    def public(self) -> dict[str, Any]:
        return {"lora_name": self.lora_name, "tasks": self.tasks, "ended": self.ended, "failed": self.failed,
                "evaluation_tasks": self.evaluation, "failure_share": self.failure_share,
                "reward": reward_summary(self.reward_n, self.reward_sum, self.reward_sq)}


@dataclass
class Decision:
    action: str  # promote | rollback | wait
    reason: str  # a stable word: see `decide`
    detail: str
    reward_delta: float | None = None
    ci95: list[float] | None = None
    arms: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason, "detail": self.detail,
                "reward_delta": self.reward_delta, "ci95": self.ci95, "arms": self.arms}


def decide(candidate: Arm, active: Arm, config: RolloutConfig, elapsed_s: float) -> Decision:
    """In order: a failure excess rolls back; with ≥ min_tasks rewarded Tasks per arm, an interval wholly below 0
    rolls back (a sure regression is never promoted, whatever the tolerance) and a lower bound ≥ −tolerance
    promotes; past max_duration, roll back or wait per `on_timeout`; else wait."""
    arms = {"candidate": candidate.public(), "active": active.public()}
    delta, ci = welch_delta(candidate.sums(), active.sums()) if candidate.reward_n and active.reward_n else (None, None)

    def verdict(action: str, reason: str, detail: str) -> Decision:
        return Decision(action, reason, detail, delta, ci, arms)

    m = config.min_tasks
    c_fail, a_fail = candidate.failure_share, active.failure_share
    if candidate.ended >= m and active.ended >= m and c_fail is not None and a_fail is not None \
            and c_fail - a_fail > config.failure_margin:
        return verdict(ROLLBACK, "failures", f"candidate failed {c_fail:.1%} of its Tasks, active {a_fail:.1%} "
                                             f"(margin {config.failure_margin:.1%})")
    if candidate.reward_n >= m and active.reward_n >= m and ci is not None:
        if ci[1] < 0:
            return verdict(ROLLBACK, "regression", f"reward difference {delta:+.4f}, 95% interval "
                                                   f"[{ci[0]:+.4f}, {ci[1]:+.4f}] is wholly below 0")
        if ci[0] >= -config.tolerance:
            return verdict(PROMOTE, "not_worse", f"reward difference {delta:+.4f}, 95% interval lower bound "
                                                 f"{ci[0]:+.4f} ≥ −{config.tolerance}")
    if elapsed_s >= config.max_duration_seconds:
        if config.on_timeout == "rollback":
            return verdict(ROLLBACK, "timeout", f"no decision within {config.max_duration_seconds} s")
        return verdict(WAIT, "timeout_waiting", f"no decision within {config.max_duration_seconds} s; waiting")
    if candidate.reward_n < m or active.reward_n < m:
        return verdict(WAIT, "collecting", f"rewarded Tasks: candidate {candidate.reward_n}, active "
                                           f"{active.reward_n}, need {m} each")
    return verdict(WAIT, "inconclusive", "the interval neither excludes 0 from above nor clears the tolerance")
