"""The rollout record (docs/rollout.md; CONTRACT §5.2 ext), typed as the Task and Training Run records are.

A rollout is a canary of a new version (`kind: canary`) or an operator's activation of a version
(`kind: activation`). The stored JSON (`rollout:{id}`) and the API's answers keep the keys, and their order, that
the untyped records had, so a record written before this type loads and is written back byte for byte:
`lineage` only on a non-default line's record, `error` only once a rollout failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from ...common.lineage import DEFAULT_LINEAGE
from .status import DECIDING, ENDED, IN_FLIGHT, LIVE

CANARY_KIND = "canary"
ACTIVATION_KIND = "activation"


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A version a rollout names: the candidate, or the baseline it is judged against (and falls back to)."""

    lora_name: str | None = None
    lora_path: str | None = None

    def stored(self) -> dict[str, Any]:
        return {"lora_name": self.lora_name, "lora_path": self.lora_path}

    @classmethod
    def from_stored(cls, data: object) -> "LoraRef":
        if not isinstance(data, dict):
            return cls()
        return cls(data.get("lora_name"), data.get("lora_path"))


@dataclass(frozen=True, slots=True)
class Rollout:
    rollout_id: str
    kind: str  # canary | activation
    status: str  # a RolloutStatus value
    created_at: str
    mode: str | None = None  # the rollout mode of a canary; `operator` for an activation
    candidate: LoraRef = field(default_factory=LoraRef)
    baseline: LoraRef = field(default_factory=LoraRef)
    share: float | None = None  # of new Tasks pinned to the candidate
    training_run_id: str | None = None  # the run whose version a canary rolls out (None: an activation)
    window_started_at: str | None = None  # the canary window: Tasks created from then on count in the arms
    ended_at: str | None = None
    decision: dict[str, Any] | None = None  # the verdict acted on, with who and when
    lineage: str = DEFAULT_LINEAGE  # stored only when not `default`
    error: str | None = None  # why it failed; stored only then

    @property
    def canary(self) -> bool:
        return self.kind == CANARY_KIND

    @property
    def live(self) -> bool:
        return self.status in LIVE

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def deciding(self) -> bool:
        return self.status in DECIDING

    @property
    def in_flight(self) -> bool:
        return self.status in IN_FLIGHT

    def evolve(self, **changes: Any) -> "Rollout":
        return replace(self, **changes)

    def public(self) -> dict[str, Any]:
        """The stored form, which is also what the API answers."""
        data: dict[str, Any] = {
            "rollout_id": self.rollout_id, "kind": self.kind, "mode": self.mode, "status": self.status,
            "candidate": self.candidate.stored(), "baseline": self.baseline.stored(), "share": self.share,
            "training_run_id": self.training_run_id, "created_at": self.created_at,
            "window_started_at": self.window_started_at, "ended_at": self.ended_at, "decision": self.decision,
        }
        if self.lineage != DEFAULT_LINEAGE:  # records of the default line stay as they were before lineages
            data["lineage"] = self.lineage
        if self.error is not None:
            data["error"] = self.error
        return data

    def to_json(self) -> bytes:
        return orjson.dumps(self.public())

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> "Rollout":
        return cls(
            rollout_id=data["rollout_id"], kind=data["kind"], status=data["status"], created_at=data["created_at"],
            mode=data.get("mode"), candidate=LoraRef.from_stored(data.get("candidate")),
            baseline=LoraRef.from_stored(data.get("baseline")), share=data.get("share"),
            training_run_id=data.get("training_run_id"), window_started_at=data.get("window_started_at"),
            ended_at=data.get("ended_at"), decision=data.get("decision"),
            lineage=data.get("lineage") or DEFAULT_LINEAGE, error=data.get("error"),
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Rollout":
        return cls.from_stored(orjson.loads(raw))
