"""What the sample store counts (satisfied by metrics.ServiceMetrics, handed in by the composition root, so the store
never imports the metrics module above it)."""

from __future__ import annotations

from typing import Protocol


class SampleMetrics(Protocol):
    def published(self, source: str) -> None: ...

    def constrained(self, kind: str, training: str) -> None: ...

    def outdated(self, n: int) -> None: ...
