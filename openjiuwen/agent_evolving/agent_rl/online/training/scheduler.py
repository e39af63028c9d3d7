"""Automatic training: the leader's duty that starts Training Runs by itself (docs/training.md, docs/lineages.md).

Each tick reads a small snapshot of the candidate lines (pending and eligible counts from the O(1) stats hash, the
eligible ones net of the samples lagging the line's observed policy as its claim counts them; the oldest pending
sample from the head of the line's pending index, its previous run end, an operator pause; the active run and a live
rollout once), lets `eligibility.rank` order the eligible lines (each judged under its lineage's policy) and starts
them in that order through `TrainingRunner.start`, the very path of `POST /v1/rl/training/runs` (claims stay
O(batch)), with the run's `trigger` naming its lineage; a start that fails falls through to the next line.

Candidates: the default line, always, and the other lines in the order of the waiting hint `rl:v1:training:waiting`
(keys.py: line → a lower bound of its oldest pending sample), read a page of `HINT_PAGE` entries at a time. Entries
of a page are first corrected from their line's own pending index (raised to its head, or removed when it is empty),
so a line whose samples were claimed, excluded or deleted drops back or out; reading stops once enough eligible
lines were found (pages are oldest first: no later line waited longer) or after `HINT_LINES_PER_TICK` lines. So a
tick never scans all lineages. A line is never chosen without a snapshot of its own keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common.ids import policy_lag_version
from ...common.lineage import DEFAULT_LINEAGE, is_lineage, line_of, split_line
from ...common.policy_names import BASE_POLICY
from ..background import stop_loop
from ..errors import DomainError, NotFound
from ..store import keys
from ..store.codec import text
from ..store.sample_status import SampleStatus
from ..store.trajectories import TrajectoryStore, stale_pending
from ..workers.fence import Fence
from .eligibility import LineState, Verdict, judge_line, rank
from .run_records import TrainingRun
from .pauses import LineagePauses
from .policy import TrainingPolicyConfig
from .runs import RunStore

if TYPE_CHECKING:
    from ..rollout.controller import RolloutController
    from .runner import TrainingRunner

log = logging.getLogger("openjiuwen.agent_rl.online.training.scheduler")

HINT_PAGE = 64  # hint entries read (and corrected) per round trip
HINT_LINES_PER_TICK = 512  # non-default lines judged per tick at most
_CORRECTION_ROUNDS = 3  # re-reads of a page whose entries moved when corrected


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC).isoformat()


class UnknownLineage(NotFound):
    """A lineage this service does not have: neither `default` nor registered in `rl:v1:lineages`."""


class TrainingScheduler:
    def __init__(
        self,
        redis: Redis,
        *,
        runs: RunStore,
        runner: "TrainingRunner",
        store: TrajectoryStore,
        rollout: "RolloutController | None",
        pauses: LineagePauses,
        fence: Fence,
        policy: TrainingPolicyConfig,
        model_id: str,
        max_policy_lag: int | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis, self._store, self._pauses = redis, store, pauses
        self._runs, self._runner, self._rollout = runs, runner, rollout
        self._fence = fence  # the hint corrections are leader-only writes
        self._policy, self._model_id, self._max_policy_lag = policy, model_id, max_policy_lag
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    @property
    def policy(self) -> TrainingPolicyConfig:
        return self._policy

    async def resolve(self, lineage: str) -> str:
        """The line of `lineage` when it exists (`default`, or registered by its first Task), else UnknownLineage."""
        if is_lineage(lineage) and (lineage == DEFAULT_LINEAGE
                                    or await self._redis.zscore(keys.LINEAGES, lineage) is not None):
            return line_of(self._model_id, lineage)
        raise UnknownLineage(f"lineage {lineage!r} does not exist")

    # ------------------------------------------------------------------ snapshot

    async def snapshot(self, line: str, lineage: str) -> LineState:
        active = await self._runs.active()
        live = await self._rollout.live_lines() if self._rollout is not None else set()
        [state] = await self._snapshots([(line, lineage)], active=active, rollout_live=live)
        return state

    async def _snapshots(
        self, lines: list[tuple[str, str]], *, active: TrainingRun | None, rollout_live: set[str]
    ) -> list[LineState]:
        """One pipelined read of every given line's own keys; the active run and the rollout are the caller's."""
        async with self._redis.pipeline(transaction=False) as reads:
            for line, lineage in lines:
                store = self._store.for_line(line)  # the line's own pending index and counters
                reads.hgetall(store.stats_key)
                reads.zrange(store.index_key(SampleStatus.PENDING), 0, 0, withscores=True)
                reads.hget(keys.TRAINING_LAST_END, line)
                reads.hexists(keys.LINEAGES_PAUSED, lineage)  # any field means paused: fails closed
                # The line's active policy as last observed (the default line's is the AIGW key): the claim
                # subtracts the samples lagging it, so the snapshot must too, or a line whose pending samples are
                # all stale would be chosen every tick and its claim fail every time.
                if lineage == DEFAULT_LINEAGE:
                    reads.get(keys.POLICY_OBSERVED)
                else:
                    reads.hget(keys.POLICY_OBSERVED_LINES, line)
            # A lineage archived or being deleted (lineage_state.py) is never trained: judged as paused. Its claim
            # refuses it anyway; this keeps the scheduler from trying every tick.
            others = [lineage for _, lineage in lines if lineage != DEFAULT_LINEAGE]
            for lineage in others:
                reads.exists(keys.lineage_state(lineage))
            rows = await reads.execute()
        retired = {lineage for lineage, found in zip(others, rows[5 * len(lines):]) if found}
        states = []
        for i, (line, lineage) in enumerate(lines):
            raw_stats, head, last_end, paused, observed = rows[5 * i:5 * i + 5]
            counters = {(text(k) or ""): int(v) for k, v in raw_stats.items()}
            pending = max(0, counters.get(f"status:{SampleStatus.PENDING}", 0))
            stale = stale_pending(counters, model_id=line, current_version=self._observed_version(observed, line),
                                  max_policy_lag=self._max_policy_lag)
            states.append(LineState(
                line=line,
                lineage=lineage,
                pending=pending,
                eligible=max(0, pending - stale),
                oldest_at=float(head[0][1]) if head else None,
                last_end_at=None if last_end is None else float(last_end),
                # One run at a time machine-wide (`training_run:active`): it blocks every line while it runs.
                active_run=None if active is None else active.training_run_id,
                # Every line rolls out its own versions (docs/lineages.md): only its own live rollout holds it.
                rollout_deciding=line in rollout_live,
                paused=bool(paused) or lineage in retired,
            ))
        return states

    @staticmethod
    def _observed_version(observed: bytes | None, line: str) -> int:
        # The policy the runner last read from the gateway (or made active); the claim re-reads it, this only
        # estimates staleness. None yet (a line never started): the base policy, and the first start records it.
        name = BASE_POLICY
        if observed is not None:
            with suppress(orjson.JSONDecodeError, AttributeError):
                name = str(orjson.loads(observed).get("lora_name") or BASE_POLICY)
        return policy_lag_version(name, line)

    # ------------------------------------------------------------------ the waiting hint

    async def waiting_page(self, offset: int) -> list[tuple[str, str]]:
        """(line, lineage) of the hint entries at ranks `offset`.. (at most HINT_PAGE), oldest first, each
        corrected to its line's oldest pending sample; lines with none left are removed from the hint and not
        returned."""
        for _ in range(_CORRECTION_ROUNDS):
            entries = await self._redis.zrange(keys.TRAINING_WAITING, offset, offset + HINT_PAGE - 1, withscores=True)
            parsed = [(text(raw) or "", float(score), self._lineage_of(text(raw) or "")) for raw, score in entries]
            async with self._redis.pipeline(transaction=False) as reads:
                for line, _, lineage in parsed:
                    if lineage is not None:
                        reads.zrange(keys.traj_index(line, SampleStatus.PENDING), 0, 0, withscores=True)
                heads = iter(await reads.execute())
            exact, corrected = [], 0
            for line, score, lineage in parsed:
                head = None if lineage is None else next(heads)
                if lineage is not None and head and float(head[0][1]) == score:
                    exact.append((line, lineage))
                    continue
                await self._correct(line, valid=lineage is not None)
                corrected += 1
            if not corrected:
                return exact
        return exact  # still moving (publications meanwhile): judge what is exact now, the rest next tick

    def _lineage_of(self, line: str) -> str | None:
        """The lineage of a hint entry's line, None for an entry that is no non-default line of this model."""
        try:
            model, lineage = split_line(line)
            keys.traj_index(line, SampleStatus.PENDING)  # a line no key may carry is no line of ours either
        except ValueError:  # InvalidLineage, InvalidIdentifier
            return None
        return lineage if model == self._model_id and lineage != DEFAULT_LINEAGE else None

    async def _correct(self, line: str, *, valid: bool) -> None:
        """Set the line's hint entry to its oldest pending sample, or remove it (also an entry we never wrote)."""
        index = keys.traj_index(line, SampleStatus.PENDING) if valid else None

        async def body(pipe: Pipeline) -> None:
            head = await pipe.zrange(index, 0, 0, withscores=True) if index is not None else []
            # Invariant (keys.TRAINING_WAITING): the pending index is WATCHed, so a sample that becomes pending
            # after this read fails the EXEC (and its own EXEC lowers the entry anyway): an entry is raised only
            # to the true head, and removed only while the index is empty.
            pipe.multi()
            if head:
                pipe.zadd(keys.TRAINING_WAITING, {line: head[0][1]})
            else:
                pipe.zrem(keys.TRAINING_WAITING, line)
            await pipe.execute()

        await self._fence.transact(self._redis, body, *([index] if index is not None else [keys.TRAINING_WAITING]))

    # ------------------------------------------------------------------ one tick

    async def tick(self) -> list[TrainingRun]:
        """Start what the policy says should start now; returns the runs created."""
        if not self._policy.any_auto:
            return []
        active = await self._runs.active()
        # Machine-wide: the one active run (whichever line it trains) takes the one slot.
        room = self._policy.max_concurrent_runs - (active is not None)
        if room <= 0:
            return []
        live = await self._rollout.live_lines() if self._rollout is not None else set()
        now = self._clock()
        states = await self._snapshots([(self._model_id, DEFAULT_LINEAGE)], active=active, rollout_live=live)
        found, seen = 0, {self._model_id}
        offset = 0
        while found < room and offset < HINT_LINES_PER_TICK:
            page = [(line, lineage) for line, lineage in await self.waiting_page(offset) if line not in seen]
            if not page:
                break
            seen.update(line for line, _ in page)
            more = await self._snapshots(page, active=active, rollout_live=live)
            found += sum(1 for state in more if judge_line(state, self._policy, now).eligible)
            states += more
            offset += HINT_PAGE
        by_line = {state.line: state for state in states}
        started: list[TrainingRun] = []
        # Every eligible line in order, not only the first `room`: a start that fails for one line (its claim
        # found fewer samples, its rollout just began) must not keep every other line from training this tick.
        for verdict in rank(states, self._policy, now):
            if len(started) >= room:
                break
            run = await self._start(by_line[verdict.line], verdict)
            if run is not None:
                started.append(run)
        return started

    async def _start(self, state: LineState, verdict: Verdict) -> TrainingRun | None:
        trigger: dict[str, Any] = {
            "kind": "auto",
            "reason": verdict.reason,
            "lineage": state.lineage,
            "pending_samples": state.pending,
            "eligible_samples": state.eligible,
            "oldest_wait_seconds": round(verdict.oldest_wait_s or 0.0, 3),
        }
        try:
            run, created = await self._runner.start(trigger=trigger, min_samples=verdict.min_samples,
                                                    lineage=state.lineage)
        except DomainError as exc:  # fewer samples at claim time, a run or rollout that just began, the gateway down
            log.info("automatic training of %s did not start: %s", state.line, exc)
            return None
        if not created:
            return None
        log.info("automatic training run %s started for %s (%s: %d eligible, oldest waited %.1f s)",
                 run.training_run_id, state.line, verdict.reason, state.eligible, verdict.oldest_wait_s or 0.0,
                 extra={"training_run_id": run.training_run_id})
        return run

    # ------------------------------------------------------------------ operator view

    async def view(self, lineage: str) -> dict[str, Any]:
        """`GET /v1/rl/lineages/{lineage}`: the pause and the scheduler's view of the lineage's line."""
        line = await self.resolve(lineage)
        state = await self.snapshot(line, lineage)
        verdict = judge_line(state, self._policy, self._clock())
        pause = await self._pauses.get(lineage)
        return {
            "lineage": lineage,
            "line": line,
            "paused": pause is not None,
            "paused_at": None if pause is None else pause.get("paused_at"),
            "training_policy": self._policy.for_lineage(lineage).model_dump(exclude={"lineages"}),
            "scheduler": {
                "pending_samples": state.pending,
                "eligible_samples": state.eligible,
                "oldest_pending_at": _iso(state.oldest_at),
                "oldest_wait_seconds": None if verdict.oldest_wait_s is None else round(verdict.oldest_wait_s, 3),
                "active_run": state.active_run,
                "rollout_deciding": state.rollout_deciding,
                "last_run_ended_at": _iso(state.last_end_at),
                "eligible": verdict.eligible,
                "reason": verdict.reason,
                "next_eligible_at": _iso(verdict.next_eligible_at),
            },
        }

    async def pause(self, lineage: str) -> dict[str, Any]:
        await self.resolve(lineage)
        await self._pauses.pause(lineage)
        return await self.view(lineage)

    async def resume(self, lineage: str) -> dict[str, Any]:
        await self.resolve(lineage)
        await self._pauses.resume(lineage)
        return await self.view(lineage)

    # ------------------------------------------------------------------ background (leader only)

    def start(self) -> None:
        if not self._policy.any_auto:
            return
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="training-scheduler")

    async def _run(self) -> None:
        interval = self._policy.poll_interval_seconds
        while not self._stopping.is_set():
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("automatic training tick failed; retrying in %.1f s", interval)
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval)

    async def stop(self) -> None:
        await stop_loop(self._task, self._stopping)
        self._task = None
