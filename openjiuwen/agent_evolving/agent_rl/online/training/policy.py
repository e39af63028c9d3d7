"""The `training_policy` section of the RL Service config (docs/training.md, automatic training).

Off by default: with `auto: false` Training Runs start only on `POST /v1/rl/training/runs`, as always. The section
is one model so that a per-lineage override (`training_policy.lineages.<name>`, issue 27) can later reuse it field by
field; it is not built yet.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator
from pydantic_core import PydanticCustomError

_Seconds = Annotated[float, Field(ge=0, strict=True, allow_inf_nan=False)]
_Positive = Annotated[StrictInt, Field(ge=1)]


class TrainingPolicyConfig(BaseModel):
    """When the leader starts a Training Run by itself (training/scheduler.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    auto: StrictBool = False
    # A line is trained once this many eligible samples are pending...
    min_pending_samples: _Positive = 32
    # ...or, with fewer, once its oldest pending sample has waited this long and at least `min_batch_on_wait` are
    # pending (null: never a smaller batch).
    max_wait_seconds: Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)] | None = None
    min_batch_on_wait: _Positive = 1
    # Between the end of a line's previous run and the start of its next one.
    min_interval_seconds: _Seconds = 0.0
    # Runs active at once on this machine, every line together.
    max_concurrent_runs: _Positive = 1
    poll_interval_seconds: Annotated[float, Field(gt=0, le=3600, strict=True, allow_inf_nan=False)] = 5.0

    @model_validator(mode="after")
    def _floor_below_threshold(self) -> "TrainingPolicyConfig":
        # A floor above the threshold would never apply: the threshold would always fire first.
        if self.min_batch_on_wait > self.min_pending_samples:
            raise PydanticCustomError("config_invalid", "min_batch_on_wait must be <= min_pending_samples")
        return self
