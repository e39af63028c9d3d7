"""The `rollout` section of the RL Service config (CONTRACT §8, docs/rollout.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictInt

from ...common.validation import ConfigModel, LoopIntervalSeconds, PositiveInt, UnitInterval

IMMEDIATE, CANARY, MANUAL = "immediate", "canary", "manual"


class RolloutConfig(ConfigModel):
    """How a succeeded Training Run's version reaches users. `immediate` (the default) activates it for every new
    Task at once; `canary` makes it the candidate for `share` of new Tasks and decides automatically; `manual`
    makes it the candidate and waits for an operator."""

    mode: Literal["immediate", "canary", "manual"] = IMMEDIATE
    share: Annotated[float, Field(gt=0, lt=1, strict=True, allow_inf_nan=False)] = 0.2
    min_tasks: Annotated[StrictInt, Field(ge=2, le=1_000_000)] = 30
    tolerance: UnitInterval = 0.05
    failure_margin: Annotated[float, Field(gt=0, le=1, strict=True, allow_inf_nan=False)] = 0.1
    max_duration_seconds: PositiveInt = 86400
    on_timeout: Literal["rollback", "wait"] = "rollback"
    decision_interval_seconds: LoopIntervalSeconds = 10.0

    @property
    def gated(self) -> bool:
        """A new version goes through a candidate (canary or manual) rather than straight to every Task."""
        return self.mode != IMMEDIATE
