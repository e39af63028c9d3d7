"""Redis transactions of a Training Run after its claim (CONTRACT §5.3): progress, PPO success, restore, terminal.

Each moves the run record, its line's active pointer and the run's samples (their hash status, status indexes and
counters, through `SampleLine.queue_move`) in one EXEC, and names the invariant of §5.4 it keeps.

Invariant 6, per line (concurrent runs, docs/training.md): every live (non-terminal) run is named by its lineage's
pointer (`training_run:active` for the default lineage, the lineage's field of `training_runs:active_lineages` for
another; keys.py), a lineage has at most one live run, at most `max_concurrent_runs` are live together, and every
`training` sample belongs to the live run of its own line and is in that run's batch (the claim, run_claims.py,
creates runs and their pointers). Only the leader writes runs: every write here goes through its fence
(store/fence.py) and raises LeaseLost once its term is over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from ...common.lineage import DEFAULT_LINEAGE
from ...common.policy_names import BASE_POLICY
from .. import events
from ..errors import NotFound
from ...common.ids import is_token_id, now_iso, parse_iso_epoch
from ..store import keys
from ..store.codec import text
from ..store.lineage_listing import RUN_LISTING
from ..store.sample_line import SampleLine
from ..store.sample_status import SampleStatus
from ..store.fence import Fence
from .run_records import RunStage, RunStatus, TrainingRun

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics

log = logging.getLogger("openjiuwen.agent_rl.online.training")

Event = tuple[str, dict[str, Any]]  # (event type, data) queued with a transition


class RunNotFound(NotFound):
    """The run record is gone (deleted by hand, lost with Redis data) while a transition wanted it. A NotFound, so
    the routes answer 404 `training_run_not_found`; the runner releases the run's batch (`RunTransitions.abandon`)."""

    def __init__(self, run_id: str) -> None:
        super().__init__("training run not found")
        self.run_id = run_id


async def _read_run(pipe: Pipeline, run_key: str, run_id: str) -> TrainingRun:
    raw = await pipe.get(run_key)
    if raw is None:
        raise RunNotFound(run_id)
    return TrainingRun.from_json(raw)


class RunTransitions:
    """A run's record, pointer and samples from its start to its end (`line`: the default line of the samples)."""

    def __init__(
        self, redis: Redis, line: SampleLine, *, model_id: str, run_retention_s: int, fence: Fence,
        metrics: "ServiceMetrics | None" = None,
    ) -> None:
        self._redis, self._fence, self._lines, self._metrics = redis, fence, line, metrics
        self._model_id, self._run_retention_s = model_id, run_retention_s

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
            store = self._lines.for_line(run.line(self._model_id))
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

    def _queue_restore(self, pipe: Pipeline, run: TrainingRun, moves: list[tuple[str, str, str, bool]],
                       at: str) -> None:
        """Queue `training → pending` for `_training_members` rows: each sample back at its original position
        (scored by `created_at`) and no longer owned by a run; `training → excluded` for a sample whose instance
        an operator excluded meanwhile (invariant 11: it never reaches another run). Back into the run's own line."""
        store = self._lines.for_line(run.line(self._model_id))
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
