"""The `training_policy` section of the RL Service config (docs/training.md, automatic training).

Off by default: with `auto: false` Training Runs start only on `POST /v1/rl/training/runs`, as always.
`training_policy.lineages.<name>` overrides the per-line fields for one lineage (docs/lineages.md): a partial
policy merged over the top-level one, so a lineage states only what differs. The per-line fields include the fair
share (`weight`) and the quotas (`max_runs_per_hour`, `max_samples_per_run`). The machine-wide fields
(`max_concurrent_runs`, `poll_interval_seconds`) are not per lineage.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, PrivateAttr, StrictBool, ValidationError, model_validator

from ...common.validation import (
    ConfigModel,
    LoopIntervalSeconds,
    NamedLineage,
    PositiveFloat,
    PositiveInt,
    config_invalid,
)

_Seconds = Annotated[float, Field(ge=0, strict=True, allow_inf_nan=False)]
_Weight = Annotated[float, Field(gt=0, le=1000, strict=True, allow_inf_nan=False)]
MAX_CONCURRENT_RUNS = 64


class LineageTrainingOverride(ConfigModel):
    """`training_policy.lineages.<name>`: the per-line fields one lineage sets differently; absent = inherited."""

    auto: StrictBool | None = None
    min_pending_samples: PositiveInt | None = None
    max_wait_seconds: PositiveFloat | None = None  # an explicit null means "never a smaller batch" (see `fields_set`)
    min_batch_on_wait: PositiveInt | None = None
    min_interval_seconds: _Seconds | None = None
    weight: _Weight | None = None
    max_runs_per_hour: PositiveInt | None = None  # an explicit null means "no quota" (see `fields_set`)
    max_samples_per_run: PositiveInt | None = None  # likewise


class TrainingPolicyConfig(ConfigModel):
    """When the leader starts a Training Run by itself (training/scheduler.py)."""

    auto: StrictBool = False
    # A line is trained once this many eligible samples are pending...
    min_pending_samples: PositiveInt = 32
    # ...or, with fewer, once its oldest pending sample has waited this long and at least `min_batch_on_wait` are
    # pending (null: never a smaller batch).
    max_wait_seconds: PositiveFloat | None = None
    min_batch_on_wait: PositiveInt = 1
    # Between the end of a line's previous run and the start of its next one.
    min_interval_seconds: _Seconds = 0.0
    # Fair share among eligible lines (training/scheduler.py): a line with weight 2 gets two runs for each run of a
    # line with weight 1 while both are eligible.
    weight: _Weight = 1.0
    # Quotas of automatic training: runs started per rolling hour (manual runs count, and are never refused), and the
    # largest batch one run of the line claims (below the service's `max_samples_per_run`; manual runs too). Null: none.
    max_runs_per_hour: PositiveInt | None = None
    max_samples_per_run: PositiveInt | None = None
    # Training Runs live at once on this service, every line together (manual runs included), at most one per
    # lineage (training/run_claims.py). Size it against the trainer: docs/training.md "Concurrent runs".
    max_concurrent_runs: Annotated[int, Field(ge=1, le=MAX_CONCURRENT_RUNS, strict=True)] = 1
    poll_interval_seconds: LoopIntervalSeconds = 5.0
    # `default` is the top-level policy itself: an entry for it would be a second, conflicting one.
    lineages: dict[NamedLineage, LineageTrainingOverride] = Field(default_factory=dict)

    _resolved: dict[str, "TrainingPolicyConfig"] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "TrainingPolicyConfig":
        # A floor above the threshold would never apply: the threshold would always fire first.
        if self.min_batch_on_wait > self.min_pending_samples:
            raise config_invalid("min_batch_on_wait must be <= min_pending_samples")
        # A cap below the smallest batch a start may claim would make every automatic start of the line fail.
        if self.max_samples_per_run is not None and self.max_samples_per_run < self.min_batch_on_wait:
            raise config_invalid("max_samples_per_run must be >= min_batch_on_wait")
        resolved = {}
        for name, override in self.lineages.items():
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
