"""The bounded `lineage` metric label: the gateway's per-request metrics (docs/lineages.md "## Gateway", wire 9)
and the RL Service's freshness histograms (docs/observability.md) both map lineages through it.

Thousands of lineages must not become thousands of Prometheus series. The rule:

- `default` always has its own label (the AIGW lineage, and the only one most deployments have);
- at most `top_k` other lineages get their own label: a lineage is granted one once its traffic reaches
  `grant_after` requests while a slot is free; traffic is counted in a heavy-hitter sketch of at most
  `SKETCH_PER_SLOT * top_k` entries (Misra-Gries: when full, every count drops by one and zeros leave), so a
  lineage seen once in a while never takes a slot and memory stays bounded whatever the number of lineages;
- a granted label is kept while its lineage has traffic, so series do not flap; once every slot is taken, a label
  whose lineage saw no counted request for `idle_s` (`metrics.lineageLabelIdle`) is released for the next lineage
  that needs a slot (`released` is told, so its series leave the page), so lineages that stopped, or made-up ones
  that one key took slots with, never hold them for the process's lifetime (issue 37 item 7); the ranking starts
  afresh at restart;
- every other lineage is `other`.

So a metric family has at most `top_k + 2` lineage values. Single event loop, no locks."""

from __future__ import annotations

import time
from collections.abc import Callable

from .lineage import DEFAULT_LINEAGE

OTHER = "other"
SKETCH_PER_SLOT = 8  # sketch entries per label slot: enough for the heavy hitters to stand out
DEFAULT_GRANT_AFTER = 10  # requests a lineage needs (in the sketch) before it takes a free slot
DEFAULT_IDLE_S = 3600.0  # config `metrics.lineageLabelIdle`


class LineageLabels:
    def __init__(self, top_k: int, *, grant_after: int = DEFAULT_GRANT_AFTER, idle_s: float = DEFAULT_IDLE_S,
                 released: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if top_k < 0 or grant_after < 1 or not idle_s > 0:
            raise ValueError("top_k must be >= 0, grant_after >= 1 and idle_s positive")
        self._top_k = top_k
        self._grant_after = grant_after
        self._idle_s = idle_s
        self._released = released
        self._clock = clock
        self._granted: dict[str, float] = {}  # lineage → when its last counted request came
        self._counts: dict[str, int] = {}
        self._sketch_size = max(1, SKETCH_PER_SLOT * top_k)

    def label(self, lineage: str) -> str:
        """The label of one request of `lineage` (counts it towards a slot)."""
        if lineage == DEFAULT_LINEAGE:
            return lineage
        now = self._clock()
        if lineage in self._granted:
            self._granted[lineage] = now
            return lineage
        if len(self._granted) >= self._top_k and not self._release_idle(now):
            return OTHER  # no slot can free up: nothing to count
        count = self._count(lineage)
        if count >= self._grant_after:
            self._granted[lineage] = now
            self._counts.pop(lineage, None)
            return lineage
        return OTHER

    def _release_idle(self, now: float) -> bool:
        """Release the label idle longest when it has been idle `idle_s`; whether a slot is free now."""
        if not self._granted:
            return False
        idlest = min(self._granted, key=self._granted.__getitem__)
        if now - self._granted[idlest] < self._idle_s:
            return False
        del self._granted[idlest]
        if self._released is not None:
            self._released(idlest)
        return True

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
