"""The claim of a Training Run (CONTRACT §5.3): the run's record, its lineage's pointer and the oldest eligible pending
samples of its line (`pending → training`, through `SampleLine.queue_move`) in one EXEC, keeping invariant 6 per
line (run_transitions.py) and invariant 5. Only the leader claims: every write goes through its fence
(store/fence.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common.lineage import DEFAULT_LINEAGE
from ...common.policy_names import BASE_POLICY
from .. import events
from ..lineage_state import require_live
from ...common.ids import epoch_iso, now_iso, parse_iso_epoch, policy_lag_version
from ..store import keys
from ..store.codec import text
from ..store.lineage_listing import RUN_LISTING
from ..store.outdated_samples import OutdatedSamples
from ..store.sample_line import SampleLine
from ..store.sample_stats import stale_pending
from ..store.sample_status import SampleStatus
from ..store.fence import Fence
from .run_records import TrainingRun

_SCAN_CHUNK = 512


@dataclass(frozen=True, slots=True)
class ClaimResult:
    run: TrainingRun | None  # the new run, or the lineage's live one when `existing`
    existing: bool
    eligible: int
    stale: int
    busy: tuple[TrainingRun, ...] = ()  # no run created: these live runs fill the room (`max_active`)


def stored_float(raw: bytes | None, default: float | None = 0.0) -> Any:
    """A float the service wrote into Redis (`repr`), `default` when absent or unreadable."""
    try:
        return default if raw is None else float(raw)
    except ValueError:
        return default


def claim_freshness(eligible_since: float | None, claimed_at: float) -> dict[str, Any]:
    """The part of a run's `freshness` known at its claim: when its line became eligible and how long it waited
    for this run (None for a run started while its line was not eligible, e.g. a manual one)."""
    return {
        "eligible_at": None if eligible_since is None else epoch_iso(eligible_since),
        "eligible_wait_seconds": None if eligible_since is None else round(max(0.0, claimed_at - eligible_since), 3),
    }


class RunClaims:
    """Claims a line's samples for a new run (`line`: the default line; each run claims from its own line)."""

    def __init__(
        self, redis: Redis, line: SampleLine, outdated: OutdatedSamples, *, model_id: str, fence: Fence,
    ) -> None:
        self._redis, self._fence, self._lines, self._outdated = redis, fence, line, outdated
        self._model_id = model_id

    @staticmethod
    def _queue_pointer(pipe: Pipeline, run: TrainingRun) -> None:
        if run.lineage == DEFAULT_LINEAGE:
            pipe.set(keys.ACTIVE_RUN, run.training_run_id)
        else:
            pipe.hset(keys.ACTIVE_LINEAGE_RUNS, run.lineage, run.training_run_id)

    async def _live(self, pipe: Pipeline) -> tuple[list[TrainingRun], str | None, dict[str, str]]:
        """(live runs, the default pointer, lineage → run id) read inside a claim (the pointers are WATCHed; each
        pointed record is WATCHed here, so a run ending before the EXEC makes the claim read again)."""
        default_id = text(await pipe.get(keys.ACTIVE_RUN))
        others = {text(k) or "": text(v) or "" for k, v in (await pipe.hgetall(keys.ACTIVE_LINEAGE_RUNS)).items()}
        run_ids = list(dict.fromkeys(r for r in (default_id, *others.values()) if r))
        if not run_ids:
            return [], default_id, others
        await pipe.watch(*(keys.training_run(r) for r in run_ids))
        raws = await pipe.mget([keys.training_run(r) for r in run_ids])
        runs = (TrainingRun.from_json(raw) for raw in raws if raw is not None)
        return [run for run in runs if not run.terminal], default_id, others

    async def claim(
        self,
        draft: TrainingRun,
        *,
        parent_version: int,
        max_policy_lag: int | None,
        min_samples: int,
        max_samples: int,
        max_active: int = 1,
        share_cost: float = 1.0,
    ) -> ClaimResult:
        """Claim the oldest eligible pending samples of the draft's line for `draft`, or return its lineage's live
        run (`existing`), or nothing when `max_active` runs are live (`busy`).

        Invariant 6 per line (module docstring): the pointers, the live records, the lineage's slot and the count
        are read under WATCH, and the pointer, the record and the pending → training moves happen in one EXEC, so
        two claims can never both see room for the same lineage or the last slot. The same EXEC charges the
        lineage's fair share (`share_cost` = 1 / its weight, start-time fair queuing: its tag becomes
        max(tag, clock) + cost and the clock that start tag) and takes the line's `eligible_since` into the record's
        `freshness`, so a run is never charged or measured twice, nor started uncharged."""
        line = draft.line(self._model_id)
        store = self._lines.for_line(line)  # the run claims its own line's samples only (per-line index: O(batch))
        pending_index = store.index_key(SampleStatus.PENDING)
        stats_key = keys.traj_stats(store.owner)
        run_key = keys.training_run(draft.training_run_id)

        async def body(pipe: Pipeline) -> ClaimResult:
            # No run claims on a lineage archived or being deleted: its state is WATCHed, so an archive that lands
            # before this EXEC fails it (the archive in turn WATCHes the lineage's run index this EXEC writes).
            await require_live(pipe, draft.lineage)
            live, default_id, others = await self._live(pipe)
            mine = next((run for run in live if run.lineage == draft.lineage), None)
            if mine is not None:
                return ClaimResult(mine, True, 0, 0)
            slot = default_id if draft.lineage == DEFAULT_LINEAGE else others.get(draft.lineage)
            # The default pointer written before concurrent runs may hold a live run of another lineage: never
            # overwrite it (its run would lose its pointer); recovery settles that run, then the slot frees.
            if len(live) >= max_active or any(run.training_run_id == slot for run in live):
                return ClaimResult(None, False, 0, 0, busy=tuple(live))
            counters = {(text(k) or ""): int(v) for k, v in (await pipe.hgetall(stats_key)).items()}
            pending = max(0, counters.get(keys.stats_status(SampleStatus.PENDING), 0))
            stale = stale_pending(
                counters, model_id=line, current_version=parent_version, max_policy_lag=max_policy_lag
            )
            eligible = max(0, pending - stale)
            if eligible < min_samples:
                return ClaimResult(None, False, eligible, stale)
            chosen = await self._oldest_eligible(pending_index, line, parent_version, max_policy_lag, max_samples)
            if len(chosen) < min_samples:
                return ClaimResult(None, False, len(chosen), stale)
            await pipe.watch(*(keys.traj(sample_id) for sample_id, _ in chosen))
            shares = await pipe.hmget(keys.FAIR_SHARE, keys.FAIR_SHARE_CLOCK, draft.lineage)
            clock, tag = (stored_float(v) for v in shares)
            since = stored_float(await pipe.hget(keys.ELIGIBLE_SINCE, line), None)
            at = now_iso()
            score = parse_iso_epoch(at)
            versions: dict[str, int] = {}
            for _, version in chosen:
                versions[version] = versions.get(version, 0) + 1
            metrics = dict(draft.metrics, stale_excluded=stale)
            start_tag = max(tag, clock)
            run = draft.evolve(
                sample_ids=[sample_id for sample_id, _ in chosen],
                sample_count=len(chosen),
                policy_versions=versions,
                metrics=metrics,
                freshness=claim_freshness(since, score),
            )
            pipe.multi()
            for sample_id, version in chosen:
                store.queue_move(
                    pipe, sample_id, old=SampleStatus.PENDING, new=SampleStatus.TRAINING, score=score,
                    policy_version=version, at=at,
                    run_id=run.training_run_id,
                )
            pipe.set(run_key, run.to_json())
            self._queue_pointer(pipe, run)
            pipe.hset(keys.FAIR_SHARE, mapping={draft.lineage: repr(start_tag + share_cost),
                                                keys.FAIR_SHARE_CLOCK: repr(start_tag)})
            pipe.hdel(keys.ELIGIBLE_SINCE, line)
            # Invariant: a run is in its lineage's listing index exactly when it is in the overall one (same EXEC).
            pipe.zadd(keys.RUNS_BY_CREATION, {run.training_run_id: parse_iso_epoch(run.created_at)})
            pipe.zadd(RUN_LISTING.index(run.lineage), {run.training_run_id: parse_iso_epoch(run.created_at)})
            events.queue(pipe, keys.training_run_events(run.training_run_id), "created", {
                "sample_count": run.sample_count, "policy_versions": versions,
                "parent_lora_name": run.parent_lora_name, "trigger": run.trigger,
            }, at=run.created_at)
            await pipe.execute()
            return ClaimResult(run, False, eligible, stale)

        return await self._fence.transact(self._redis, body, keys.ACTIVE_RUN, keys.ACTIVE_LINEAGE_RUNS, pending_index,
                                          stats_key, keys.FAIR_SHARE, keys.ELIGIBLE_SINCE)

    async def _oldest_eligible(
        self, pending_index: str, line: str, parent_version: int, max_policy_lag: int | None, limit: int
    ) -> list[tuple[str, str]]:
        """(sample id, policy version) of the oldest eligible pending samples, in index order."""
        chosen: list[tuple[str, str]] = []
        offset = 0
        while len(chosen) < limit:
            chunk = limit if max_policy_lag is None else _SCAN_CHUNK
            members = [text(m) or "" for m in await self._redis.zrange(pending_index, offset, offset + chunk - 1)]
            if not members:
                break
            offset += len(members)
            async with self._redis.pipeline(transaction=False) as reads:
                for sample_id in members:
                    reads.hget(keys.traj(sample_id), "policy_version")
                versions = [text(v) or BASE_POLICY for v in await reads.execute()]
            for sample_id, version in zip(members, versions):
                lag = parent_version - policy_lag_version(version, line)
                if max_policy_lag is None or lag <= max_policy_lag:
                    chosen.append((sample_id, version))
                    if len(chosen) == limit:
                        break
        return chosen

    async def retire_outdated(self, line: str, *, current_version: int, max_policy_lag: int | None) -> int:
        """The line's pending samples lagging `current_version` past `max_policy_lag` become `outdated`
        (`OutdatedSamples.retire_outdated`), through this leader's fence."""
        return await self._outdated.retire_outdated(
            self._lines.for_line(line), current_version=current_version, max_policy_lag=max_policy_lag,
            fence=self._fence)
