"""Policy lines: what each line serves (its active version and canary candidate) and where that went wrong.

A line is what a policy switch changes. Today there is one line per base model; lineages will make it one per (model,
lineage). Everything else reaches a line through `PolicyLines.of` / `PolicyLines.get` and the line's `model`, so that
change stays inside this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

from .canary import Candidate
from ..common.ids import model_of
from .lora_types import ActiveLora


@dataclass
class PolicyLine:
    model: str  # the base model whose instances serve the line
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # serializes the line's switches
    active: ActiveLora | None = None
    candidate: Candidate | None = None  # the canary version beside the active one (docs/rollout.md)
    failed: set[str] = field(default_factory=set)  # instances that could not load the active version
    artifact_missing: bool = False  # the active version's directory is gone or invalid

    def serves(self, lora_name: str) -> bool:
        """Active or candidate: new Tasks may be pinned to it, so it must stay loaded."""
        return (self.active is not None and self.active.lora_name == lora_name) or (
            self.candidate is not None and self.candidate.lora_name == lora_name)


class PolicyLines:
    def __init__(self) -> None:
        self._lines: dict[str, PolicyLine] = {}

    def get(self, model: str) -> PolicyLine | None:
        """The line, when anything ever happened on it."""
        return self._lines.get(model)

    def of(self, model: str) -> PolicyLine:
        """The line, created on first use."""
        line = self._lines.get(model)
        if line is None:
            line = self._lines[model] = PolicyLine(model)
        return line

    def of_version(self, lora_name: str) -> PolicyLine | None:
        """The line a version belongs to (None for a name that is no version, or of a line never used)."""
        model = model_of(lora_name)
        return self._lines.get(model) if model is not None else None

    def __iter__(self) -> Iterator[PolicyLine]:
        return iter(list(self._lines.values()))
