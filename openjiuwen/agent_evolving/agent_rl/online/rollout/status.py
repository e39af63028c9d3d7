"""The rollout state machine (docs/rollout.md): a canary `running` | `paused` → `promoting` | `rolling_back` →
`promoted` | `rolled_back`; an operator's activation `activating` → `activated` | `failed`. The intermediate states
are written before the gateway call, so a restart finishes the call it was making."""

from __future__ import annotations

from enum import StrEnum

from ..transitions import Transitions


class RolloutStatus(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    PROMOTING = "promoting"
    ROLLING_BACK = "rolling_back"
    ACTIVATING = "activating"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"
    ACTIVATED = "activated"
    FAILED = "failed"


S = RolloutStatus
# A refused promotion turns into a rollback; a refused rollback or activation ends `failed`.
ROLLOUT_TRANSITIONS = Transitions("rollout", {
    S.RUNNING: {S.PAUSED, S.PROMOTING, S.ROLLING_BACK},
    S.PAUSED: {S.RUNNING, S.PROMOTING, S.ROLLING_BACK},
    S.PROMOTING: {S.PROMOTED, S.ROLLING_BACK},
    S.ROLLING_BACK: {S.ROLLED_BACK, S.FAILED},
    S.ACTIVATING: {S.ACTIVATED, S.FAILED},
    S.PROMOTED: set(),
    S.ROLLED_BACK: set(),
    S.ACTIVATED: set(),
    S.FAILED: set(),
})
DECIDING = frozenset({S.RUNNING, S.PAUSED})  # a canary still waiting for its decision
IN_FLIGHT = frozenset({S.PROMOTING, S.ROLLING_BACK, S.ACTIVATING})  # a gateway call under way
ENDED = frozenset(s for s in RolloutStatus if ROLLOUT_TRANSITIONS.terminal(s))
LIVE = frozenset(RolloutStatus) - ENDED
