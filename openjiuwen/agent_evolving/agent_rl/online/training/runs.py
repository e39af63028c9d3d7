"""Redis transactions of Training Runs (CONTRACT §5.3): claim, progress, PPO success, restore, terminal.

Each moves the run record, its line's active pointer and the claimed samples (their hash status, status indexes and
counters, through `TrajectoryStore.queue_move`) in one EXEC, and names the invariant of §5.4 it keeps.

Invariant 6, per line (concurrent runs, docs/training.md): every live (non-terminal) run is named by its lineage's
pointer (`training_run:active` for the default lineage, the lineage's field of `training_runs:active_lineages` for
another; keys.py), a lineage has at most one live run, at most `max_concurrent_runs` are live together, and every
`training` sample belongs to the live run of its own line and is in that run's batch. Only the
leader writes runs: every write here goes through its fence (store/fence.py) and raises LeaseLost once its term
is over; reads, and the listing's removal of expired ids (any worker's `GET`), do not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from ...common.lineage import DEFAULT_LINEAGE
from ...common.policy_names import BASE_POLICY
from .. import events
from ..errors import NotFound
from ..lineage_state import require_live
from ...common.ids import epoch_iso, is_token_id, now_iso, parse_iso_epoch, policy_lag_version
from ..store import keys
from ..store.codec import text
from ..store.lineage_listing import RUN_LISTING
from ..store.listing import newest_first
from ..store.sample_status import SampleStatus
from ..store.trajectories import TrajectoryStore, stale_pending
from ..store.fence import Fence
from .run_records import RunStage, RunStatus, TrainingRun

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics

log = logging.getLogger("openjiuwen.agent_rl.online.training")

Event = tuple[str, dict[str, Any]]  # (event type, data) queued with a transition
_SCAN_CHUNK = 512


@dataclass(frozen=True, slots=True)
class ClaimResult:
    run: TrainingRun | None  # the new run, or the lineage's live one when `existing`
    existing: bool
    eligible: int
    stale: int
    busy: tuple[TrainingRun, ...] = ()  # no run created: these live runs fill the room (`max_active`)


class RunNotFound(NotFound):
    """The run record is gone (deleted by hand, lost with Redis data) while a transition wanted it. A NotFound, so
    the routes answer 404 `training_run_not_found`; the runner releases the run's batch (`RunStore.abandon`)."""

    def __init__(self, run_id: str) -> None:
        super().__init__("training run not found")
        self.run_id = run_id


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


async def _read_run(pipe: Pipeline, run_key: str, run_id: str) -> TrainingRun:
    raw = await pipe.get(run_key)
    if raw is None:
        raise RunNotFound(run_id)
    return TrainingRun.from_json(raw)


class RunStore:
    def __init__(
        self, redis: Redis, store: TrajectoryStore, *, model_id: str, run_retention_s: int, fence: Fence,
        metrics: "ServiceMetrics | None" = None,
    ) -> None:
        self._redis, self._fence, self._store, self._metrics = redis, fence, store, metrics
        self._model_id, self._run_retention_s = model_id, run_retention_s

    async def get(self, run_id: str) -> TrainingRun | None:
        raw = await self._redis.get(keys.training_run(run_id))
        return None if raw is None else TrainingRun.from_json(raw)

    async def last_end(self, line: str) -> float | None:
        """Epoch the line's previous run ended (any terminal status), None when it never had one."""
        raw = await self._redis.hget(keys.TRAINING_LAST_END, line)
        return None if raw is None else float(raw)

    async def active_runs(self) -> list[TrainingRun]:
        """Every live run, named by the pointers (one consistent read of both, then their records)."""
        async with self._redis.pipeline(transaction=True) as reads:
            reads.get(keys.ACTIVE_RUN)
            reads.hgetall(keys.ACTIVE_LINEAGE_RUNS)
            default_id, others = await reads.execute()
        run_ids = list(dict.fromkeys(r for r in (text(default_id), *(text(v) for v in others.values())) if r))
        raws = await self._redis.mget([keys.training_run(r) for r in run_ids]) if run_ids else []
        runs = (TrainingRun.from_json(raw) for raw in raws if raw is not None)
        return [run for run in runs if not run.terminal]

    async def active_of(self, lineage: str) -> TrainingRun | None:
        """The live run of `lineage`, None when it has none."""
        return next((run for run in await self.active_runs() if run.lineage == lineage), None)

    @staticmethod
    def _queue_pointer(pipe: Pipeline, run: TrainingRun) -> None:
        if run.lineage == DEFAULT_LINEAGE:
            pipe.set(keys.ACTIVE_RUN, run.training_run_id)
        else:
            pipe.hset(keys.ACTIVE_LINEAGE_RUNS, run.lineage, run.training_run_id)

    @staticmethod
    async def _pointers_of(pipe: Pipeline, run: TrainingRun) -> tuple[bool, bool]:
        """Whether the default pointer and the lineage's field name `run` (the caller WATCHes both keys). The
        default pointer may name a run of another lineage when it was written before runs were concurrent."""
        default = text(await pipe.get(keys.ACTIVE_RUN)) == run.training_run_id
        field = (run.lineage != DEFAULT_LINEAGE
                 and text(await pipe.hget(keys.ACTIVE_LINEAGE_RUNS, run.lineage)) == run.training_run_id)
        return default, field

    @staticmethod
    def _queue_unpoint(pipe: Pipeline, run: TrainingRun, pointers: tuple[bool, bool]) -> None:
        default, field = pointers
        if default:
            pipe.delete(keys.ACTIVE_RUN)
        if field:
            pipe.hdel(keys.ACTIVE_LINEAGE_RUNS, run.lineage)

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
        store = self._store.for_line(line)  # the run claims its own line's samples only (per-line index: O(batch))
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

    async def update(
        self, run_id: str, change: Callable[[TrainingRun], TrainingRun], *, event: Event | None = None
    ) -> TrainingRun:
        """Apply `change` to a non-terminal record (progress, stage moves) with its timeline event, in one EXEC; a
        terminal record is returned as is."""
        run_key = keys.training_run(run_id)

        async def body(pipe: Pipeline) -> TrainingRun:
            run = await _read_run(pipe, run_key, run_id)
            if run.terminal:
                return run
            new = change(run)
            pipe.multi()
            pipe.set(run_key, new.to_json())
            if event is not None:
                events.queue(pipe, keys.training_run_events(run_id), *event)
            await pipe.execute()
            return new

        return await self._fence.transact(self._redis, body, run_key)

    async def mark_trained(
        self, run_id: str, *, lora_name: str, lora_path: str, dropped_ids: Sequence[str], metrics_patch: dict
    ) -> TrainingRun:
        """PPO success, one step: the batch leaves `training` (dropped samples → `failed`, the rest → `trained`)
        and the record moves to `activating` with its artifact. Invariants 5 and 6."""
        run_key = keys.training_run(run_id)
        dropped = set(dropped_ids)

        async def body(pipe: Pipeline) -> TrainingRun:
            run = await _read_run(pipe, run_key, run_id)
            if run.terminal:
                return run
            moves = await self._training_members(pipe, run)
            at = now_iso()
            score = parse_iso_epoch(at)
            new = run.evolve(
                stage=RunStage.ACTIVATING.value, lora_name=lora_name, lora_path=lora_path,
                metrics={**run.metrics, **metrics_patch},
            )
            failed = sum(1 for sample_id, *_ in moves if sample_id in dropped)
            pipe.multi()
            store = self._store.for_line(run.line(self._model_id))
            for sample_id, version, *_ in moves:
                target = SampleStatus.FAILED if sample_id in dropped else SampleStatus.TRAINED
                store.queue_move(
                    pipe, sample_id, old=SampleStatus.TRAINING, new=target, score=score, policy_version=version,
                    at=at,
                )
            pipe.set(run_key, new.to_json())
            if is_token_id(lora_name):  # the new version's lineage, for GET /v1/rl/policies
                pipe.hset(keys.policy_stats(lora_name), mapping={
                    "parent": run.parent_lora_name, "training_run_id": run_id,
                })
                pipe.sadd(keys.POLICY_VERSIONS, lora_name)
            stream = keys.training_run_events(run_id)
            events.queue(pipe, stream, "artifact_published", {"lora_name": lora_name, "lora_path": lora_path}, at=at)
            events.queue(pipe, stream, "samples_trained", {"trained": len(moves) - failed, "failed": failed}, at=at)
            await pipe.execute()
            return new

        return await self._fence.transact(self._redis, body, run_key)

    async def finish(
        self,
        run_id: str,
        status: RunStatus,
        *,
        failure_reason: str | None = None,
        restore_samples: bool = False,
        before: Sequence[Event] = (),
        freshness: dict[str, Any] | None = None,
    ) -> TrainingRun:
        """Terminal transition: record + TTL, its pointer deleted, the `before` events and the terminal event
        appended (the timeline gets the record's TTL); with `restore_samples`, the batch's `training` samples go
        back to `pending` at their original position in the same EXEC; `freshness` merged into the record's.
        Invariants 5, 6 and 8."""
        run_key = keys.training_run(run_id)

        async def body(pipe: Pipeline) -> TrainingRun:
            run = await _read_run(pipe, run_key, run_id)
            if run.terminal:
                return run
            moves = await self._training_members(pipe, run) if restore_samples else []
            pointers = await self._pointers_of(pipe, run)
            at = now_iso()
            done = run.evolve(status=status.value, finished_at=at, failure_reason=failure_reason)
            if freshness:
                done = done.evolve(freshness={**(run.freshness or {}), **freshness})
            pipe.multi()
            self._queue_restore(pipe, run, moves, at)
            pipe.set(run_key, done.to_json(), ex=self._run_retention_s)
            pipe.zadd(keys.RUNS_LISTING_EXPIRY, {run_id: parse_iso_epoch(at) + self._run_retention_s})
            RUN_LISTING.queue_expiring(pipe, run_id, run.lineage)  # which lineage index to trim then
            self._queue_unpoint(pipe, run, pointers)
            # The line's last run end moves with the terminal record, so `min_interval_seconds` of automatic
            # training (training/scheduler.py) always counts from the end of the run that really ended last.
            pipe.hset(keys.TRAINING_LAST_END, run.line(self._model_id), parse_iso_epoch(at))
            stream = keys.training_run_events(run_id)
            for event_type, data in before:
                events.queue(pipe, stream, event_type, data, at=at)
            events.queue(pipe, stream, status.value, {
                "failure_reason": failure_reason, "restored_samples": len(moves),
            }, at=at)
            pipe.expire(stream, self._run_retention_s)
            await pipe.execute()
            transitioned.append(True)
            return done

        transitioned: list[bool] = []
        done = await self._fence.transact(self._redis, body, run_key, keys.ACTIVE_RUN, keys.ACTIVE_LINEAGE_RUNS)
        if transitioned and self._metrics is not None:
            self._metrics.run_finished(done.status)
        return done

    async def abandon(self, run: TrainingRun) -> int:
        """Release a run whose record vanished, from the copy its execution holds: the samples still `training`
        under it go back to `pending` at their original position and the pointer that names the run is deleted, in
        one EXEC. Invariant 6 (every `training` sample belongs to the live run of its line) holds again and the
        next claim of the lineage can proceed. A record that reappeared meanwhile is left to its own transitions.
        Returns the number of samples restored."""
        run_id = run.training_run_id
        run_key = keys.training_run(run_id)

        async def body(pipe: Pipeline) -> int:
            if await pipe.exists(run_key):
                return 0
            moves = await self._training_members(pipe, run)
            pointers = await self._pointers_of(pipe, run)
            at = now_iso()
            pipe.multi()
            self._queue_restore(pipe, run, moves, at)
            self._queue_unpoint(pipe, run, pointers)
            await pipe.execute()
            return len(moves)

        return await self._fence.transact(self._redis, body, run_key, keys.ACTIVE_RUN, keys.ACTIVE_LINEAGE_RUNS)

    def _queue_restore(self, pipe: Pipeline, run: TrainingRun, moves: list[tuple[str, str, str, bool]],
                       at: str) -> None:
        """Queue `training → pending` for `_training_members` rows: each sample back at its original position
        (scored by `created_at`) and no longer owned by a run; `training → excluded` for a sample whose instance
        an operator excluded meanwhile (invariant 11: it never reaches another run). Back into the run's own line."""
        store = self._store.for_line(run.line(self._model_id))
        for sample_id, version, created_at, excluded in moves:
            new, score = ((SampleStatus.EXCLUDED, parse_iso_epoch(at)) if excluded
                          else (SampleStatus.PENDING, parse_iso_epoch(created_at)))
            store.queue_move(pipe, sample_id, old=SampleStatus.TRAINING, new=new, score=score,
                             policy_version=version, at=at, run_id="")

    async def _training_members(self, pipe: Pipeline, run: TrainingRun) -> list[tuple[str, str, str, bool]]:
        """(id, policy version, created_at, whether its instance is excluded) of the run's samples still `training`
        under this run; their hashes and the excluded set are WATCHed so a concurrent change fails the EXEC."""
        if not run.sample_ids:
            return []
        hash_keys = [keys.traj(s) for s in run.sample_ids]
        await pipe.watch(*hash_keys, keys.EXCLUDED_INSTANCES)
        async with self._redis.pipeline(transaction=False) as reads:
            for key in hash_keys:
                reads.hmget(key, "status", "run_id", "policy_version", "created_at", "instance")
            reads.smembers(keys.EXCLUDED_INSTANCES)
            *rows, raw_excluded = await reads.execute()
        excluded = {text(m) for m in raw_excluded}
        out = []
        for sample_id, (status, owner_run, version, created_at, instance) in zip(run.sample_ids, rows):
            if text(status) == SampleStatus.TRAINING and text(owner_run) == run.training_run_id:
                out.append((sample_id, text(version) or BASE_POLICY, text(created_at) or now_iso(),
                            bool(instance) and text(instance) in excluded))
        return out

    async def record_freshness(self, run_id: str, freshness: dict[str, Any]) -> TrainingRun | None:
        """Merge `freshness` into a run's record, terminal or not (a measurement, not a transition: a canary's version
        becomes the line's policy at its promotion, long after its run ended), keeping the record's TTL. None when
        the record is gone."""
        run_key = keys.training_run(run_id)

        async def body(pipe: Pipeline) -> TrainingRun | None:
            raw = await pipe.get(run_key)
            if raw is None:
                return None
            run = TrainingRun.from_json(raw)
            new = run.evolve(freshness={**(run.freshness or {}), **freshness})
            pipe.multi()
            pipe.set(run_key, new.to_json(), keepttl=True)
            await pipe.execute()
            return new

        return await self._fence.transact(self._redis, body, run_key)

    async def retire_outdated(self, line: str, *, current_version: int, max_policy_lag: int | None) -> int:
        """The line's pending samples lagging `current_version` past `max_policy_lag` become `outdated`
        (`TrajectoryStore.retire_outdated`), through this leader's fence."""
        return await self._store.for_line(line).retire_outdated(
            current_version=current_version, max_policy_lag=max_policy_lag, fence=self._fence)

    async def list_page(self, limit: int, cursor: str | None, lineage: str | None = None) -> dict[str, Any]:
        """Public run records newest first (`GET /v1/rl/training/runs`); with `lineage`, from that lineage's own
        index (O(page)). Ids of expired records leave the indexes."""
        index, scope = ((keys.RUNS_BY_CREATION, "runs") if lineage is None
                        else (RUN_LISTING.index(lineage), f"runs/{lineage}"))
        ids, next_cursor = await newest_first(self._redis, index, limit=limit, cursor=cursor, scope=scope)
        raws = await self._redis.mget([keys.training_run(r) for r in ids]) if ids else []
        gone = [r for r, raw in zip(ids, raws) if raw is None]
        if gone:
            lineages = ([lineage] * len(gone) if lineage is not None
                        else await RUN_LISTING.lineages_of(self._redis, gone))
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zrem(keys.RUNS_BY_CREATION, *gone)
                pipe.zrem(keys.RUNS_LISTING_EXPIRY, *gone)
                RUN_LISTING.queue_forget(pipe, gone, lineages)
                await pipe.execute()
        runs = [TrainingRun.from_json(raw) for raw in raws if raw is not None]
        items = [run.public() for run in runs if lineage is None or run.lineage == lineage]
        return {"items": items, "next_cursor": next_cursor}

    async def events(self, run_id: str) -> list[dict[str, Any]] | None:
        """The run timeline oldest first, or None for an unknown run."""
        if not await self._redis.exists(keys.training_run(run_id)):
            return None
        return await events.EventLog(self._redis).read(keys.training_run_events(run_id))

    async def append_event(self, run_id: str, event_type: str, data: dict[str, Any]) -> None:
        """A best-effort event that belongs to no transition (activation attempt, stop request, recovery): a Redis
        failure is logged, a refused term (LeaseLost) is raised like any of the leader's writes."""
        stream = keys.training_run_events(run_id)
        try:
            await self._fence.write(self._redis, lambda pipe: events.queue(pipe, stream, event_type, data))
        except RedisError as exc:
            log.warning("event %s could not be appended to %s: %s", event_type, stream, exc)

    async def observe_policy(self, lora_name: str, lora_path: str, *, line: str | None = None) -> None:
        """Remember the last active policy of `line` (default: the default line) read from the gateway or made
        active here (used for `stale` in stats and by the scheduler). Fenced: a deposed leader gets LeaseLost."""
        observed = orjson.dumps({"lora_name": lora_name, "lora_path": lora_path, "at": now_iso()})
        if line is None or line == self._model_id:
            await self._fence.write(self._redis, lambda pipe: pipe.set(keys.POLICY_OBSERVED, observed))
        else:
            await self._fence.write(self._redis, lambda pipe: pipe.hset(keys.POLICY_OBSERVED_LINES, line, observed))
