"""The `training_policy` section of the RL Service config (docs/training.md, automatic training).

Off by default: with `auto: false` Training Runs start only on `POST /v1/rl/training/runs`, as always.
`training_policy.lineages.<name>` overrides the per-line fields for one lineage (docs/lineages.md): a partial
policy merged over the top-level one, so a lineage states only what differs. The machine-wide fields
(`max_concurrent_runs`, `poll_interval_seconds`) are not per lineage.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, ValidationError, model_validator

from ...common.lineage import DEFAULT_LINEAGE, is_lineage
from ...common.validation import config_invalid

_Seconds = Annotated[float, Field(ge=0, strict=True, allow_inf_nan=False)]
_Positive = Annotated[StrictInt, Field(ge=1)]
_Wait = Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)]



class LineageTrainingOverride(BaseModel):
    """`training_policy.lineages.<name>`: the per-line fields one lineage sets differently; absent = inherited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    auto: StrictBool | None = None
    min_pending_samples: _Positive | None = None
    max_wait_seconds: _Wait | None = None  # an explicit null means "never a smaller batch" (see `fields_set`)
    min_batch_on_wait: _Positive | None = None
    min_interval_seconds: _Seconds | None = None


class TrainingPolicyConfig(BaseModel):
    """When the leader starts a Training Run by itself (training/scheduler.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    auto: StrictBool = False
    # A line is trained once this many eligible samples are pending...
    min_pending_samples: _Positive = 32
    # ...or, with fewer, once its oldest pending sample has waited this long and at least `min_batch_on_wait` are
    # pending (null: never a smaller batch).
    max_wait_seconds: _Wait | None = None
    min_batch_on_wait: _Positive = 1
    # Between the end of a line's previous run and the start of its next one.
    min_interval_seconds: _Seconds = 0.0
    # Runs active at once on this machine, every line together. The service runs one Training Run at a time
    # (the single `training_run:active` pointer): a value above 1 is refused rather than accepted and not honoured.
    max_concurrent_runs: Annotated[int, Field(ge=1, le=1, strict=True)] = 1
    poll_interval_seconds: Annotated[float, Field(gt=0, le=3600, strict=True, allow_inf_nan=False)] = 5.0
    lineages: dict[str, LineageTrainingOverride] = Field(default_factory=dict)

    _resolved: dict[str, "TrainingPolicyConfig"] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "TrainingPolicyConfig":
        # A floor above the threshold would never apply: the threshold would always fire first.
        if self.min_batch_on_wait > self.min_pending_samples:
            raise config_invalid("min_batch_on_wait must be <= min_pending_samples")
        resolved = {}
        for name, override in self.lineages.items():
            # `default` is the top-level policy itself: an entry for it would be a second, conflicting one.
            if not is_lineage(name) or name == DEFAULT_LINEAGE:
                raise config_invalid(f"lineages.{name}: not a lineage name other than default")
            merged = self.model_dump(exclude={"lineages"}) | override.model_dump(include=override.model_fields_set)
            try:
                resolved[name] = TrainingPolicyConfig(**merged)
            except ValidationError as exc:  # the merge broke a rule (e.g. the floor above the threshold)
                raise config_invalid(f"lineages.{name}: {exc.errors()[0]['msg']}") from None
        self._resolved = resolved
        return self

    def for_lineage(self, lineage: str) -> "TrainingPolicyConfig":
        """The policy a lineage's line follows: its override merged over this one, or this one."""
        return self._resolved.get(lineage, self)

    @property
    def any_auto(self) -> bool:
        """Whether some line may be trained automatically (the scheduler runs at all)."""
        return self.auto or any(p.auto for p in self._resolved.values())
