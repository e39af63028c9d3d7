"""Policy lines: what each line serves (its active version and canary candidate) and where that went wrong.

A line is what a policy switch changes: one per (model, lineage), named as common/lineage.py says (the bare model id
for the lineage `default`, `<model>:<lineage>` otherwise). Everything else reaches a line through `PolicyLines.of` /
`PolicyLines.get`, and the instances that serve it through the line's `model`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

from ...common.lineage import InvalidLineage, parse_version_name, split_line
from .canary import Candidate
from .lora_types import ActiveLora


def line_of_version(lora_name: object) -> str | None:
    """The line of a version name `<line>:vN`, else None (base, or no version name)."""
    parsed = parse_version_name(lora_name)
    return parsed[0] if parsed is not None else None


def model_of_version(lora_name: object) -> str | None:
    """The base model whose instances serve a version `<line>:vN`, else None."""
    line = line_of_version(lora_name)
    return split_line(line)[0] if line is not None else None


def model_of_line(line: str) -> str:
    """The model of a well-formed line; InvalidLineage otherwise."""
    return split_line(line)[0]


@dataclass
class PolicyLine:
    name: str  # the line: `<model>` or `<model>:<lineage>`
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

    def get(self, line: str) -> PolicyLine | None:
        """The line, when anything ever happened on it."""
        return self._lines.get(line)

    def of(self, line: str) -> PolicyLine:
        """The line, created on first use; InvalidLineage for a malformed line name."""
        found = self._lines.get(line)
        if found is None:
            found = self._lines[line] = PolicyLine(line, model_of_line(line))
        return found

    def of_version(self, lora_name: str) -> PolicyLine | None:
        """The line a version belongs to (None for a name that is no version, or of a line never used)."""
        line = line_of_version(lora_name)
        return self._lines.get(line) if line is not None else None

    def __iter__(self) -> Iterator[PolicyLine]:
        return iter(list(self._lines.values()))


__all__ = ["InvalidLineage", "PolicyLine", "PolicyLines", "line_of_version", "model_of_line", "model_of_version"]
