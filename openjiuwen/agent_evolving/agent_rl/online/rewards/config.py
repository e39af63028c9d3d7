"""The `reward_policy` section of `RLServiceConfig`: named reward sources and how their scores combine.

`terminal` and `judge` are the built-in sources: the publication path supplies one of them with the sample (Task
reward projection, delayed-feedback turn or rail-v1 upload), so they carry only a weight. Every other name is an
external source posted later through `POST /v1/rl/trajectories/{id}/rewards`; it needs a deadline (seconds after
publication) and a fallback applied when the deadline passes without a score.

`lineages.<name>` replaces the sources and aggregation for the samples of one lineage (docs/lineages.md): a whole
policy, not a merge, so what a lineage's samples wait for reads from one place.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from ...common.validation import (
    ConfigModel,
    LoopIntervalSeconds,
    NamedLineage,
    PositiveFloat,
    PositiveInt,
    UnitInterval,
    config_invalid,
)

BUILTIN_SOURCES = ("terminal", "judge")
SOURCE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
MAX_SOURCES = 16

Aggregation = Literal["weighted_mean", "last", "min"]
Fallback = Literal["skip", "default", "drop"]



class RewardSourceConfig(ConfigModel):
    """One reward source. External sources need `deadline_seconds`; `default_score` is set iff `fallback: default`."""

    weight: PositiveFloat = 1.0
    deadline_seconds: PositiveInt | None = None
    fallback: Fallback | None = None
    default_score: UnitInterval | None = None


class RewardRulesConfig(ConfigModel):
    """The sources and their aggregation: the whole policy of one lineage (`reward_policy.lineages.<name>`)."""

    aggregation: Aggregation = "weighted_mean"
    sources: dict[str, RewardSourceConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_sources(self) -> "RewardRulesConfig":
        if len(self.sources) > MAX_SOURCES:
            raise config_invalid(f"at most {MAX_SOURCES} sources")
        for name, source in self.sources.items():
            if not SOURCE_NAME.fullmatch(name):
                raise config_invalid("source names are 1-32 of [a-z0-9_-], starting with a letter")
            if name in BUILTIN_SOURCES:
                if source.deadline_seconds is not None or source.fallback is not None or (
                    source.default_score is not None
                ):
                    raise config_invalid(f"sources.{name}: arrives with publication; only weight applies")
                continue
            if source.deadline_seconds is None:
                raise config_invalid(f"sources.{name}: deadline_seconds is required for an external source")
            if (source.fallback == "default") != (source.default_score is not None):
                raise config_invalid(f"sources.{name}: default_score is required with fallback default, and only then")
        return self

    def external_sources(self) -> tuple[str, ...]:
        return tuple(name for name in self.sources if name not in BUILTIN_SOURCES)


class RewardPolicyConfig(RewardRulesConfig):
    """`reward_policy` (docs/rewards.md). Absent (null) = today's behaviour: a published sample is pending at once."""

    # The sweeper wakes at the earliest deadline it knows of, and at least this often to see deadlines of samples
    # published by other service processes.
    sweep_interval_seconds: LoopIntervalSeconds = 10.0
    # Per-lineage policies (docs/lineages.md): a lineage listed here follows its own sources and aggregation
    # (`default` is the top-level policy itself: an entry for it would be a second, conflicting one).
    lineages: dict[NamedLineage, RewardRulesConfig] = Field(default_factory=dict)
