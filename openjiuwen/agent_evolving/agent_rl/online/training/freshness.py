"""Freshness of a line's policy (docs/training.md "Freshness"): how long a sample waits until a version trained on it
serves its line.

When the version a run trained becomes its line's policy — the run's activation (`rollout.mode: immediate`) or the
promotion of its canary — each sample the run trained (`trained` under that run: dropped ones were not trained on)
contributes its latency from creation to that moment. The run record gets the count, p50, p95 and max in
`freshness.sample_to_policy_seconds` with `policy_at` and `policy_via`; the histogram `rl_sample_to_policy_seconds`
gets every sample. The claim recorded the other half, the line's eligible-to-run wait (training/run_claims.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis

from ...common.ids import epoch_iso, parse_iso_epoch
from ..store import keys
from ..store.codec import text
from ..store.sample_status import SampleStatus
from .run_records import TrainingRun
from .run_reads import RunReads
from .run_transitions import RunTransitions

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics

ACTIVATION, PROMOTION = "activation", "promotion"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile (0 < q <= 1) of ascending values."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def summary(latencies: Sequence[float]) -> dict[str, Any] | None:
    if not latencies:
        return None
    ordered = sorted(latencies)
    return {"count": len(ordered), "p50": round(percentile(ordered, 0.5), 3),
            "p95": round(percentile(ordered, 0.95), 3), "max": round(ordered[-1], 3)}


class Freshness:
    def __init__(
        self, redis: Redis, reads: RunReads, runs: RunTransitions, metrics: "ServiceMetrics | None" = None
    ) -> None:
        self._redis, self._reads, self._runs, self._metrics = redis, reads, runs, metrics

    async def measure(self, run: TrainingRun, *, at: float, via: str) -> dict[str, Any]:
        """The `freshness` fields of `run` once its version became the line's policy at epoch `at` (histogram
        observed); the caller writes them with its transition."""
        latencies = await self._latencies(run, at)
        if self._metrics is not None:
            self._metrics.policy_live(run.lineage, latencies)
        return {"policy_at": epoch_iso(at), "policy_via": via, "sample_to_policy_seconds": summary(latencies)}

    async def promoted(self, run_id: str, at: float) -> None:
        """A canary of `run_id` was promoted at epoch `at`: measure and patch its (terminal) record."""
        run = await self._reads.get(run_id)
        if run is None:
            return  # expired meanwhile: nothing to record in
        await self._runs.record_freshness(run_id, await self.measure(run, at=at, via=PROMOTION))

    async def _latencies(self, run: TrainingRun, at: float) -> list[float]:
        if not run.sample_ids:
            return []
        async with self._redis.pipeline(transaction=False) as reads:
            for sample_id in run.sample_ids:
                reads.hmget(keys.traj(sample_id), "status", "run_id", "created_at")
            rows = await reads.execute()
        out = []
        for status, owner, created in rows:
            if text(status) == SampleStatus.TRAINED and text(owner) == run.training_run_id and created:
                out.append(max(0.0, at - parse_iso_epoch(text(created) or "")))
        return out
