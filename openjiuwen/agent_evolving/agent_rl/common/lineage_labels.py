"""The bounded `lineage` metric label: the gateway's per-request metrics (docs/lineages.md "## Gateway", wire 9)
and the RL Service's freshness histograms (docs/observability.md) both map lineages through it.

Thousands of lineages must not become thousands of Prometheus series. The rule:

- `default` always has its own label (the AIGW lineage, and the only one most deployments have);
- at most `top_k` other lineages get their own label: a lineage is granted one once its traffic reaches
  `grant_after` requests while a slot is free; traffic is counted in a heavy-hitter sketch of at most
  `SKETCH_PER_SLOT * top_k` entries (Misra-Gries: when full, every count drops by one and zeros leave), so a
  lineage seen once in a while never takes a slot and memory stays bounded whatever the number of lineages;
- a granted label is kept until the process restarts, so series do not flap; the ranking starts afresh at restart;
- every other lineage is `other`.

So a metric family has at most `top_k + 2` lineage values. Single event loop, no locks."""

from __future__ import annotations

from .lineage import DEFAULT_LINEAGE

OTHER = "other"
SKETCH_PER_SLOT = 8  # sketch entries per label slot: enough for the heavy hitters to stand out
DEFAULT_GRANT_AFTER = 10  # requests a lineage needs (in the sketch) before it takes a free slot


class LineageLabels:
    def __init__(self, top_k: int, *, grant_after: int = DEFAULT_GRANT_AFTER) -> None:
        if top_k < 0 or grant_after < 1:
            raise ValueError("top_k must be >= 0 and grant_after >= 1")
        self._top_k = top_k
        self._grant_after = grant_after
        self._granted: set[str] = set()
        self._counts: dict[str, int] = {}
        self._sketch_size = max(1, SKETCH_PER_SLOT * top_k)

    def label(self, lineage: str) -> str:
        """The label of one request of `lineage` (counts it towards a slot)."""
        if lineage == DEFAULT_LINEAGE or lineage in self._granted:
            return lineage
        if len(self._granted) >= self._top_k:
            return OTHER  # no slot can free up: nothing to count
        count = self._count(lineage)
        if count >= self._grant_after:
            self._granted.add(lineage)
            self._counts.pop(lineage, None)
            return lineage
        return OTHER

    def known(self, lineage: str) -> str:
        """The label `lineage` has now, without counting traffic (for events that follow a counted request)."""
        return lineage if lineage == DEFAULT_LINEAGE or lineage in self._granted else OTHER

    def granted(self) -> frozenset[str]:
        return frozenset(self._granted)

    def _count(self, lineage: str) -> int:
        if lineage in self._counts or len(self._counts) < self._sketch_size:
            self._counts[lineage] = self._counts.get(lineage, 0) + 1
            return self._counts[lineage]
        # Full: this arrival and every tracked count cancel one each (Misra-Gries); zeros leave the sketch.
        self._counts = {name: n - 1 for name, n in self._counts.items() if n > 1}
        return 0
