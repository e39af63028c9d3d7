"""The `rollout` section of the RL Service config (CONTRACT §8, docs/rollout.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

IMMEDIATE, CANARY, MANUAL = "immediate", "canary", "manual"


class RolloutConfig(BaseModel):
    """How a succeeded Training Run's version reaches users. `immediate` (the default) activates it for every new
    Task at once; `canary` makes it the candidate for `share` of new Tasks and decides automatically; `manual`
    makes it the candidate and waits for an operator."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["immediate", "canary", "manual"] = IMMEDIATE
    share: Annotated[float, Field(gt=0, lt=1, strict=True, allow_inf_nan=False)] = 0.2
    min_tasks: Annotated[StrictInt, Field(ge=2, le=1_000_000)] = 30
    tolerance: Annotated[float, Field(ge=0, le=1, strict=True, allow_inf_nan=False)] = 0.05
    failure_margin: Annotated[float, Field(gt=0, le=1, strict=True, allow_inf_nan=False)] = 0.1
    max_duration_seconds: Annotated[StrictInt, Field(ge=1)] = 86400
    on_timeout: Literal["rollback", "wait"] = "rollback"
    decision_interval_seconds: Annotated[float, Field(gt=0, le=3600, strict=True, allow_inf_nan=False)] = 10.0

    @property
    def gated(self) -> bool:
        """A new version goes through a candidate (canary or manual) rather than straight to every Task."""
        return self.mode != IMMEDIATE
