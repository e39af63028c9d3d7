"""The Training Run record and its state machines as data (CONTRACT §4.7)."""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

import orjson

from ...common.lineage import DEFAULT_LINEAGE, line_of
from ...common.policy_names import BASE_POLICY
from ..transitions import Transitions


class RunStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


class RunStage(StrEnum):
    QUEUED = "queued"
    TRAINING = "training"
    ACTIVATING = "activating"


# What the runner does today: a claimed run starts (`running`) or is stopped/failed before it starts (a stop, a
# restart); a running one ends succeeded (activated, or its canary started), failed or canceled. Ends are sticky:
# `RunTransitions` returns a terminal record unchanged, so a move out of one is a bug and raises.
RUN_TRANSITIONS = Transitions("training run", {
    RunStatus.PENDING: {RunStatus.RUNNING, RunStatus.FAILED, RunStatus.CANCELED},
    RunStatus.RUNNING: {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELED},
    RunStatus.SUCCEEDED: set(),
    RunStatus.FAILED: set(),
    RunStatus.CANCELED: set(),
})
# The stage only moves forward: training starts, then the trained artifact is being activated.
RUN_STAGE_TRANSITIONS = Transitions("training run stage", {
    RunStage.QUEUED: {RunStage.TRAINING},
    RunStage.TRAINING: {RunStage.ACTIVATING},
    RunStage.ACTIVATING: set(),
})
TERMINAL_STATUSES = frozenset(status for status in RunStatus if RUN_TRANSITIONS.terminal(status))
PRIVATE_FIELDS = ("sample_ids", "parent_lora_name", "parent_lora_path")


def new_run_id() -> str:
    return "run-" + secrets.token_hex(6)


def manual_trigger() -> dict[str, Any]:
    """Why a run started when an operator asked (`POST /v1/rl/training/runs`); also what a record written before
    triggers were recorded reads as (every run then was manual)."""
    return {"kind": "manual"}


def empty_metrics() -> dict[str, Any]:
    return {
        "steps": 0,
        "step_metrics": [],
        "dropped_samples": 0,
        "prompt_truncated_samples": 0,
        "response_truncated_samples": 0,
        "stale_excluded": 0,
    }


@dataclass(frozen=True, slots=True)
class TrainingRun:
    training_run_id: str
    status: str
    stage: str
    sample_count: int
    policy_versions: dict[str, int]
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    failure_reason: str | None = None
    metrics: dict[str, Any] = field(default_factory=empty_metrics)
    sample_ids: list[str] = field(default_factory=list)
    parent_lora_name: str = BASE_POLICY
    parent_lora_path: str = ""
    # Why it started: {"kind": "manual"} or {"kind": "auto", "reason", "lineage", the counts at that moment}.
    trigger: dict[str, Any] = field(default_factory=manual_trigger)
    # The model id (the service's) and the lineage whose line the run trains (docs/lineages.md). `model_id` is
    # never stored: it is the service's own. `lineage` is stored and answered only when not `default`, so the
    # default line's records stay byte-for-byte as before lineages.
    lineage: str = DEFAULT_LINEAGE
    # Freshness (docs/training.md "Freshness"): `eligible_at` / `eligible_wait_seconds` written by the claim, then
    # `policy_at`, `policy_via` (activation | promotion) and `sample_to_policy_seconds` {count, p50, p95, max} once
    # the version trained on the batch became its line's policy. Absent until the claim (records written before).
    freshness: dict[str, Any] | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def evolve(self, **changes: Any) -> "TrainingRun":
        """A copy with `changes`; a status or stage move the tables forbid raises IllegalTransition (writing the
        same value again, as a retried transition does, is no move)."""
        if changes.get("status", self.status) != self.status:
            RUN_TRANSITIONS.check(self.status, changes["status"])
        if changes.get("stage", self.stage) != self.stage:
            RUN_STAGE_TRANSITIONS.check(self.stage, changes["stage"])
        return replace(self, **changes)

    def line(self, model_id: str) -> str:
        return line_of(model_id, self.lineage)

    def _stored(self) -> dict[str, Any]:
        data = asdict(self)
        if self.lineage == DEFAULT_LINEAGE:
            del data["lineage"]
        if self.freshness is None:
            del data["freshness"]
        return data

    def public(self) -> dict[str, Any]:
        data = self._stored()
        for name in PRIVATE_FIELDS:
            data.pop(name)
        return data

    def to_json(self) -> bytes:
        return orjson.dumps(self._stored(), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "TrainingRun":
        data = orjson.loads(raw)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
