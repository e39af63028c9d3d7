"""What the gateway tells about its LoRA state, from what it knows now (no vLLM call): `GET /v1/loras/{model}`
(CONTRACT §3.3), the canary body (§3.8), the instance listing (§3.9) and the console's view of a model."""

from __future__ import annotations

from typing import Any

from ..instances.instances import Instance, InstanceRegistry
from .holdings import Holdings
from .leases import Leases
from .lora_types import LoraStatus
from .policy_lines import PolicyLines, model_of_line
from .routing import Router


class LoraViews:
    def __init__(self, registry: InstanceRegistry, holdings: Holdings, leases: Leases, lines: PolicyLines,
                 routing: Router) -> None:
        self._registry = registry
        self._holdings = holdings
        self._leases = leases
        self._lines = lines
        self._routing = routing

    def status(self, line_name: str) -> dict[str, Any]:
        """The `GET /v1/loras/{line}` body (a line: docs/lineages.md). Counts serving instances only: an unhealthy one
        is outside the quorum, neither ready nor failed."""
        instances = self._registry.serving(model_of_line(line_name))
        line = self._lines.get(line_name)
        if line is None or line.active is None:
            answer = {"status": LoraStatus.BASE, "active_lora": None, "instances": {"ready": len(instances), "failed": 0}}
            return self._with_candidate(line_name, answer)
        name = line.active.lora_name
        ready = sum(1 for i in instances if self._holdings.holds(i.name, name))
        failed = sum(1 for i in instances if i.name in line.failed and not self._holdings.holds(i.name, name))
        status = LoraStatus.DEGRADED if failed or line.artifact_missing else LoraStatus.ACTIVE
        answer = {"status": status, "active_lora": line.active.public(), "instances": {"ready": ready, "failed": failed}}
        return self._with_candidate(line_name, answer)

    def canary_status(self, line: str) -> dict[str, Any]:
        """`status(line)` with the candidate (null when none) and the lease count per version of the line."""
        return {**self.status(line), "candidate": self._candidate_row(line), "leases": self._leases.counts(line)}

    def describe(self, line_name: str) -> dict[str, Any]:
        """The web console's view of a line (the model id for the default lineage): `status(line)`, each instance of
        the line's model with the adapters confirmed loaded on it and its requests in flight, and the leases (Tasks
        pinned to a version) of the line's versions."""
        line = self._lines.get(line_name)
        failed = line.failed if line is not None else set()
        instances = [
            {**self._instance_row(i), "failed": i.name in failed}
            for i in self._registry.for_model(model_of_line(line_name))
        ]
        return {**self.status(line_name), "model": line_name, "instance_list": instances,
                "leases": self._leases.counts(line_name)}

    def instances(self) -> list[dict[str, Any]]:
        """Every instance with its origin, health and adapters (`GET /aigw/v1/instances`)."""
        return [self._instance_row(i) for i in self._registry.all()]

    def _with_candidate(self, line: str, answer: dict[str, Any]) -> dict[str, Any]:
        """A canary's candidate is reported beside the active version (the key is absent without one)."""
        row = self._candidate_row(line)
        return {**answer, "candidate": row} if row is not None else answer

    def _candidate_row(self, line_name: str) -> dict[str, Any] | None:
        line = self._lines.get(line_name)
        candidate = line.candidate if line is not None else None
        if candidate is None:
            return None
        ready = sum(1 for i in self._registry.serving(line.model) if self._holdings.holds(i.name, candidate.lora_name))
        return {**candidate.public(), "instances": {"ready": ready}}

    def _instance_row(self, i: Instance) -> dict[str, Any]:
        return {"name": i.name, "model": i.model, "address": f"{i.host}:{i.port}",
                "origin": "static" if self._registry.is_static(i.name) else "registered",
                "serving": self._registry.is_serving(i.name), "loaded": sorted(self._holdings.confirmed(i.name)),
                "inflight": self._routing.in_flight_count(i.name)}
