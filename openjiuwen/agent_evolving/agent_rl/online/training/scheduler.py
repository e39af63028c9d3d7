"""Automatic training: the leader's duty that starts Training Runs by itself (docs/training.md, docs/lineages.md).

Each tick judges the lines that are due, starts the eligible ones in fair-share order (training/eligibility.py)
while there is room (`max_concurrent_runs` minus the live runs), through `TrainingRunner.start`, the very path of
`POST /v1/rl/training/runs` (claims stay O(batch)), with the run's `trigger` naming its lineage; a start that fails
falls through to the next line.

Which lines are due: the default line, always, and every line whose entry in the due index `rl:v1:training:waiting`
(keys.py: line → the epoch by which it must be judged) has come. A publication, a reward arrival, a run giving its
samples back, a resume and the leader's start lower a line's entry; a judgement raises it to the line's next due time
(its `max_wait_seconds`, `min_interval_seconds` or `max_runs_per_hour` end), keeps it due while it is eligible or
its run or rollout holds it (at most the live runs and rollouts), or removes the entry of a line that only another
write could make eligible (nothing pending, below its floor, paused, automatic training off for it). So a lineage
waiting below its threshold is read once per publication, never at every tick, and any number of them never hides
an eligible line: every due line is judged in the tick (in chunks of `JUDGE_CHUNK`), and an eligible line is due.

A chunk is judged in one fenced transaction that WATCHes the chunk's pending indexes: its snapshot (pending and
eligible counts from the O(1) stats hash, net of the samples lagging the line's observed policy; the oldest pending
sample; the previous run end; an operator pause; the fair-share tag; the recent starts of a lineage under a quota) is
read after the WATCH, and the entries and the lines' `eligible_since` are written in its EXEC, so a sample that
becomes pending meanwhile fails the EXEC rather than being judged away. Lines holding samples that lag their policy
past `max_policy_lag` then have those samples moved to `outdated` (store/outdated_samples.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common.ids import epoch_iso, policy_lag_version
from ...common.lineage import DEFAULT_LINEAGE, is_lineage, line_of, split_line
from ...common.policy_names import BASE_POLICY
from ..background import stop_loop
from ..errors import DomainError, NotFound
from ..store import keys
from ..store.codec import text
from ..store.lineage_listing import RUN_LISTING
from ..store.sample_status import SampleStatus
from ..store.outdated_samples import OutdatedSamples
from ..store.sample_line import SampleLine
from ..store.sample_stats import stale_pending
from ..store.tx import RedisContention
from ..store.fence import Fence
from .eligibility import (HOUR_S, INTERVAL, QUOTA, ROLLOUT_DECIDING, RUN_ACTIVE, WAITING, LineState, Verdict,
                          judge_line, rank)
from .pauses import LineagePauses
from .training_policy import TrainingPolicyConfig
from .run_claims import stored_float
from .run_reads import RunReads

if TYPE_CHECKING:
    from ..rollout.controller import RolloutController
    from .run_records import TrainingRun
    from .runner import TrainingRunner

log = logging.getLogger("openjiuwen.agent_rl.online.training.scheduler")

DUE_PAGE = 500  # due-index entries (or registered lineages, at the leader's start) read per round trip
JUDGE_CHUNK = 100  # lines judged (and their entries written) per fenced transaction
# Entries kept due until the verdict's time; the rest of the not-eligible reasons drop the line's entry.
_TIMED = (INTERVAL, QUOTA, WAITING)
_HELD = (RUN_ACTIVE, ROLLOUT_DECIDING)  # judged again at every tick (at most the live runs and rollouts)


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else epoch_iso(epoch)


class UnknownLineage(NotFound):
    """A lineage this service does not have: neither `default` nor registered in `rl:v1:lineages`."""


class TrainingScheduler:
    def __init__(
        self,
        redis: Redis,
        *,
        runs: RunReads,
        runner: "TrainingRunner",
        line: SampleLine,
        outdated: OutdatedSamples,
        rollout: "RolloutController | None",
        pauses: LineagePauses,
        fence: Fence,
        policy: TrainingPolicyConfig,
        model_id: str,
        max_policy_lag: int | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis, self._lines, self._outdated, self._pauses = redis, line, outdated, pauses
        self._runs, self._runner, self._rollout = runs, runner, rollout
        self._fence = fence  # the due index, `eligible_since` and outdated samples are leader-only writes
        self._policy, self._model_id, self._max_policy_lag = policy, model_id, max_policy_lag
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._all_due = False  # every registered line made due once in this term (`_make_every_line_due`)

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
        active = {run.lineage: run.training_run_id for run in await self._runs.active_runs()}
        live = await self._rollout.live_lines() if self._rollout is not None else set()
        [state] = await self._snapshots([(line, lineage)], active=active, rollout_live=live, now=self._clock())
        return state

    async def _snapshots(
        self, lines: Sequence[tuple[str, str]], *, active: dict[str, str], rollout_live: set[str], now: float
    ) -> list[LineState]:
        """One pipelined read of every given line's own keys; the live runs and rollouts are the caller's."""
        quotas = {lineage: self._policy.for_lineage(lineage).max_runs_per_hour for _, lineage in lines}
        names = [line for line, _ in lines]
        lineages = [lineage for _, lineage in lines]
        others = [lineage for lineage in lineages if lineage != DEFAULT_LINEAGE]
        async with self._redis.pipeline(transaction=False) as reads:
            for line, lineage in lines:
                store = self._lines.for_line(line)  # the line's own pending index and counters
                reads.hgetall(store.stats_key)
                reads.zrange(store.index_key(SampleStatus.PENDING), 0, 0, withscores=True)
                if quotas[lineage] is not None:  # the lineage's newest starts within the hour, at most its quota
                    reads.zrevrangebyscore(RUN_LISTING.index(lineage), "+inf", repr(now - HOUR_S), start=0,
                                           num=quotas[lineage], withscores=True)
            # One field per line of each shared hash: a read per chunk, not per line.
            reads.hmget(keys.TRAINING_LAST_END, names)
            reads.hmget(keys.LINEAGES_PAUSED, lineages)  # any field means paused: fails closed
            # The line's active policy as last observed (the default line's is the AIGW key): the claim subtracts
            # the samples lagging it, so the snapshot must too, or a line whose pending samples are all stale would
            # be chosen every tick and its claim fail every time.
            reads.hmget(keys.POLICY_OBSERVED_LINES, names)
            reads.get(keys.POLICY_OBSERVED)
            reads.hmget(keys.ELIGIBLE_SINCE, names)
            reads.hmget(keys.FAIR_SHARE, [keys.FAIR_SHARE_CLOCK, *lineages])
            # A lineage archived or being deleted (lineage_state.py) is never trained: judged as paused. Its claim
            # refuses it anyway; this keeps the scheduler from trying every tick. (The default lineage has no state.)
            if others:
                reads.mget([keys.lineage_state(lineage) for lineage in others])
            results = await reads.execute()
        retired = {lineage for lineage, state in zip(others, results.pop() if others else []) if state is not None}
        *rows, last_ends, paused, observed_lines, observed_default, since, shares = results
        clock = stored_float(shares[0])
        states, at = [], 0
        for i, (line, lineage) in enumerate(lines):
            raw_stats, head = rows[at:at + 2]
            at += 2
            recent: tuple[float, ...] = ()
            if quotas[lineage] is not None:
                recent = tuple(float(score) for _, score in rows[at])
                at += 1
            counters = {(text(k) or ""): int(v) for k, v in raw_stats.items()}
            pending = max(0, counters.get(keys.stats_status(SampleStatus.PENDING), 0))
            observed = observed_default if lineage == DEFAULT_LINEAGE else observed_lines[i]
            version = self._observed_version(observed, line)
            stale = stale_pending(counters, model_id=line, current_version=version,
                                  max_policy_lag=self._max_policy_lag)
            states.append(LineState(
                line=line,
                lineage=lineage,
                pending=pending,
                eligible=max(0, pending - stale),
                oldest_at=float(head[0][1]) if head else None,
                last_end_at=stored_float(last_ends[i], None),
                # The lineage's own live run holds its line; other lineages' runs hold only the shared room.
                active_run=active.get(lineage),
                # Every line rolls out its own versions (docs/lineages.md): only its own live rollout holds it.
                rollout_deciding=line in rollout_live,
                paused=paused[i] is not None or lineage in retired,
                share_tag=max(stored_float(shares[i + 1]), clock),
                recent_starts=recent,
                eligible_since=stored_float(since[i], None),
                policy_version=version,
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

    # ------------------------------------------------------------------ the due index

    async def due_lines(self, now: float) -> list[tuple[str, str]]:
        """(line, lineage) of every entry due by `now`, oldest first; entries that name no line of this model's
        lineages are removed."""
        due: list[tuple[str, str]] = []
        foreign: list[str] = []
        offset = 0
        while True:
            page = [text(m) or "" for m in await self._redis.zrangebyscore(
                keys.TRAINING_WAITING, "-inf", repr(now), start=offset, num=DUE_PAGE)]
            for line in page:
                lineage = self._lineage_of(line)
                if lineage is None:
                    foreign.append(line)
                else:
                    due.append((line, lineage))
            if len(page) < DUE_PAGE:
                break
            offset += DUE_PAGE
        if foreign:
            await self._fence.write(self._redis, lambda pipe: pipe.zrem(keys.TRAINING_WAITING, *foreign))
        return due

    def _lineage_of(self, line: str) -> str | None:
        """The lineage of an entry's line, None for an entry that is no non-default line of this model."""
        try:
            model, lineage = split_line(line)
            keys.traj_index(line, SampleStatus.PENDING)  # a line no key may carry is no line of ours either
        except ValueError:  # InvalidLineage, InvalidIdentifier
            return None
        return lineage if model == self._model_id and lineage != DEFAULT_LINEAGE else None

    async def _make_every_line_due(self) -> None:
        """Once per term, before the first judgement: every registered lineage's line becomes due (ZADD LT: an
        earlier entry stays), so a line dropped under another config (a lineage's `auto`, a threshold) or by an
        earlier leader is judged anew. Costs one read of the registry at the leader's start, never at a tick."""
        now = self._clock()
        start = 0
        while True:
            page = [text(m) or "" for m in await self._redis.zrange(keys.LINEAGES, start, start + DUE_PAGE - 1)]
            lines = {line_of(self._model_id, name): now for name in page
                     if is_lineage(name) and name != DEFAULT_LINEAGE}
            if lines:
                await self._fence.write(self._redis, lambda pipe: pipe.zadd(keys.TRAINING_WAITING, lines, lt=True))
            if len(page) < DUE_PAGE:
                break
            start += DUE_PAGE

    async def _judge(self, lines: Sequence[tuple[str, str]], *, active: dict[str, str], rollout_live: set[str],
                     now: float) -> list[tuple[LineState, Verdict]]:
        """Judge a chunk of lines and file each one's entry and `eligible_since` (module docstring)."""
        watched = [keys.traj_index(line, SampleStatus.PENDING) for line, lineage in lines if lineage != DEFAULT_LINEAGE]

        async def body(pipe: Pipeline) -> list[tuple[LineState, Verdict]]:
            states = await self._snapshots(lines, active=active, rollout_live=rollout_live, now=now)
            judged = [(state, judge_line(state, self._policy, now)) for state in states]
            # Invariant (keys.TRAINING_WAITING): the lines' pending indexes are WATCHed and the snapshot was read
            # after, so an entry is raised or removed only on a judgement of what is pending now; a sample made
            # pending meanwhile fails this EXEC (and its own EXEC lowered the entry anyway).
            pipe.multi()
            for state, verdict in judged:
                if state.lineage != DEFAULT_LINEAGE:
                    self._queue_entry(pipe, state.line, verdict)
                if verdict.eligible:
                    pipe.hsetnx(keys.ELIGIBLE_SINCE, state.line, repr(now))  # the first tick that found it so
                elif state.eligible_since is not None:
                    pipe.hdel(keys.ELIGIBLE_SINCE, state.line)
            await pipe.execute()
            return judged

        try:
            return await self._fence.transact(self._redis, body, *watched)
        except RedisContention:
            # Publications keep landing on these lines: their entries stay due, so the next tick judges them.
            log.warning("automatic training: %d line(s) kept changing while judged; judged again next tick",
                        len(lines))
            return []

    @staticmethod
    def _queue_entry(pipe: Pipeline, line: str, verdict: Verdict) -> None:
        if verdict.eligible or verdict.reason in _HELD:
            return  # stays due: judged at every tick until it starts, or its run or rollout ends
        if verdict.reason in _TIMED and verdict.next_eligible_at is not None:
            pipe.zadd(keys.TRAINING_WAITING, {line: verdict.next_eligible_at})
        else:
            pipe.zrem(keys.TRAINING_WAITING, line)

    async def _retire_outdated(self, states: Sequence[LineState]) -> None:
        """Lines holding samples that lag their observed policy past `max_policy_lag`: those become `outdated`."""
        for state in states:
            if state.pending > state.eligible:
                moved = await self._outdated.retire_outdated(
                    self._lines.for_line(state.line), current_version=state.policy_version,
                    max_policy_lag=self._max_policy_lag, fence=self._fence)
                if moved:
                    log.info("%d sample(s) of %s are outdated (policy lag past %s)", moved, state.line,
                             self._max_policy_lag)

    # ------------------------------------------------------------------ one tick

    async def tick(self) -> list["TrainingRun"]:
        """Start what the policy says should start now; returns the runs created."""
        if not self._policy.any_auto:
            return []
        if not self._all_due:
            await self._make_every_line_due()
            self._all_due = True
        now = self._clock()
        live_runs = await self._runs.active_runs()
        active = {run.lineage: run.training_run_id for run in live_runs}
        live = await self._rollout.live_lines() if self._rollout is not None else set()
        candidates = [(self._model_id, DEFAULT_LINEAGE), *await self.due_lines(now)]
        judged: list[tuple[LineState, Verdict]] = []
        for start in range(0, len(candidates), JUDGE_CHUNK):
            judged += await self._judge(candidates[start:start + JUDGE_CHUNK], active=active, rollout_live=live,
                                        now=now)
        await self._retire_outdated([state for state, _ in judged])
        room = self._policy.max_concurrent_runs - len(live_runs)
        by_line = {state.line: state for state, _ in judged}
        started: list["TrainingRun"] = []
        # Every eligible line in fair-share order, not only the first `room`: a start that fails for one line (its
        # claim found fewer samples, its rollout just began) must not keep every other line from training this tick.
        for verdict in rank(by_line.values(), self._policy, now):
            if len(started) >= room:
                break
            run = await self._start(by_line[verdict.line], verdict)
            if run is not None:
                started.append(run)
        return started

    async def _start(self, state: LineState, verdict: Verdict) -> "TrainingRun | None":
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
        quota = self._policy.for_lineage(lineage).max_runs_per_hour
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
                "eligible_since": _iso(state.eligible_since),
                "fair_share_tag": round(state.share_tag, 6),
                "runs_last_hour": None if quota is None else len(state.recent_starts),
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
        self._all_due = False  # a new term: its first tick makes every registered line due
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
