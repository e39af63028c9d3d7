"""Pure reward-policy logic: which sources a sample waits for, arrivals, deadlines, fallbacks, aggregation.

A sample's reward state (hash field `rewards` of `traj:{id}`, JSON) is
`{"published_at": epoch, "sources": {name: {"score": float | null, "at": epoch, "kind": k}}, "score": float | null}`
with kind `published` (the built-in source of the publication path), `arrived` (posted), `default` (fallback
score at the deadline) or `skipped` (fallback skip). A source of the policy that is not yet in `sources` is open.
The state is always judged against the current policy, so removing a source from the config releases samples
waiting for it at their next sweep, and no I/O happens here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from enum import StrEnum
from typing import Any

from ..errors import Conflict
from ..store.reward_view import breakdown
from ..store.sample_status import SampleStatus
from ...common.lineage import DEFAULT_LINEAGE
from .config import BUILTIN_SOURCES, RewardPolicyConfig, RewardRulesConfig


class SourceKind(StrEnum):
    """How a source's entry in a reward state got its score (the `kind` of the module docstring)."""

    PUBLISHED = "published"
    ARRIVED = "arrived"
    DEFAULT = "default"
    SKIPPED = "skipped"


class RewardConflict(Conflict):
    code = "reward_conflict"


@dataclass(frozen=True, slots=True)
class Expiry:
    """What the deadlines due at one instant did to a state."""

    state: dict[str, Any]
    drop: bool  # a `drop` fallback fired: the sample leaves the store
    fallbacks: tuple[str, ...]  # sources whose fallback fired


class RewardPolicy:
    def __init__(self, config: RewardPolicyConfig | None, *, rules: RewardRulesConfig | None = None) -> None:
        top = config or RewardPolicyConfig()
        self._config: RewardRulesConfig = rules or top
        self.configured = config is not None
        self.aggregation = self._config.aggregation
        self.external = self._config.external_sources()
        self.sweep_interval_s = top.sweep_interval_seconds
        # One policy object per overridden lineage, built once (docs/lineages.md, `reward_policy.lineages`).
        self._lineages = {} if rules is not None else {
            name: RewardPolicy(config, rules=override) for name, override in top.lineages.items()
        }
        # Every external source of any lineage: a source none of them declares is refused before any read.
        self.any_external = frozenset(self.external).union(*(p.external for p in self._lineages.values()))

    def for_lineage(self, lineage: str | None) -> "RewardPolicy":
        """The policy the samples of `lineage` follow: its override, else this (the top-level) one."""
        if not lineage or lineage == DEFAULT_LINEAGE:
            return self
        return self._lineages.get(lineage, self)

    def weight(self, source: str) -> float:
        declared = self._config.sources.get(source)
        return declared.weight if declared is not None else 1.0

    def deadline(self, state: dict[str, Any], source: str) -> float:
        declared = self._config.sources[source]
        assert declared.deadline_seconds is not None  # validated for external sources
        return float(state["published_at"]) + declared.deadline_seconds

    # ------------------------------------------------------------------ transitions

    def initial(self, judge: Any, now: float) -> dict[str, Any]:
        """The state at publication: the built-in source that published the sample (its `judge.source`), if any."""
        sources: dict[str, Any] = {}
        if isinstance(judge, dict) and judge.get("source") in BUILTIN_SOURCES and _is_score(judge.get("score")):
            sources[str(judge["source"])] = {"score": float(judge["score"]), "at": now, "kind": SourceKind.PUBLISHED}
        return self._scored({"published_at": now, "sources": sources})

    def open_sources(self, state: dict[str, Any]) -> list[str]:
        return [name for name in self.external if name not in state["sources"]]

    def status(self, state: dict[str, Any]) -> SampleStatus:
        return SampleStatus.AWAITING_REWARDS if self.open_sources(state) else SampleStatus.PENDING

    def next_deadline(self, state: dict[str, Any]) -> float | None:
        deadlines = [self.deadline(state, name) for name in self.open_sources(state)]
        return min(deadlines) if deadlines else None

    def arrive(self, state: dict[str, Any], source: str, score: float, now: float) -> dict[str, Any] | None:
        """The state with `source` scored, or None when it already holds that very score (idempotent repeat).
        A different score for a source that arrived is a conflict; a fallback entry is replaced by the real score."""
        if source not in self.external:
            raise ValueError(f"{source} is not an external reward source")
        entry = state["sources"].get(source)
        if entry is not None and entry["kind"] == SourceKind.ARRIVED:
            if entry["score"] == score:
                return None
            raise RewardConflict(f"reward source {source} already has a different score")
        sources = {**state["sources"], source: {"score": score, "at": now, "kind": SourceKind.ARRIVED}}
        return self._scored({**state, "sources": sources})

    def expire(self, state: dict[str, Any], now: float) -> Expiry:
        """Apply the fallback of every open source whose deadline is at or before `now`."""
        sources = dict(state["sources"])
        fired = []
        for name in self.open_sources(state):
            at = self.deadline(state, name)
            if at > now:
                continue
            fired.append(name)
            declared = self._config.sources[name]
            fallback = declared.fallback or "skip"
            if fallback == "drop":
                return Expiry(state, True, tuple(fired))
            if fallback == "default":
                sources[name] = {"score": declared.default_score, "at": at, "kind": SourceKind.DEFAULT}
            else:
                sources[name] = {"score": None, "at": at, "kind": SourceKind.SKIPPED}
        return Expiry(self._scored({**state, "sources": sources}), False, tuple(fired))

    def view(self, state: dict[str, Any]) -> dict[str, Any]:
        """`breakdown` plus the open sources and their deadlines."""
        out = breakdown(state, self.aggregation)
        out["waiting_for"] = {name: iso_at(self.deadline(state, name)) for name in self.open_sources(state)}
        return out

    # ------------------------------------------------------------------ aggregation

    def _scored(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "score": self.aggregate(state["sources"])}

    def aggregate(self, sources: dict[str, Any]) -> float | None:
        """weighted_mean: Σ wᵢ·sᵢ / Σ wᵢ; last: the score that arrived last (ties: the later source in the policy);
        min: the lowest. Over the sources with a score; None when none has one."""
        scored = [(name, e) for name, e in sources.items() if e.get("score") is not None]
        if not scored:
            return None
        if self.aggregation == "min":
            return min(float(e["score"]) for _, e in scored)
        if self.aggregation == "last":
            order = {name: i for i, name in enumerate(self._config.sources)}
            _, latest = max(scored, key=lambda item: (float(item[1]["at"]), order.get(item[0], -1)))
            return float(latest["score"])
        total = sum(self.weight(name) for name, _ in scored)
        return sum(self.weight(name) * float(e["score"]) for name, e in scored) / total


def iso_at(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat()


def _is_score(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= float(value) <= 1.0
