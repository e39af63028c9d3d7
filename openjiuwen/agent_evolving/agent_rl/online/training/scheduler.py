"""Automatic training: the leader's duty that starts Training Runs by itself (docs/training.md).

Each tick reads a small snapshot of every line (pending and eligible counts from the O(1) stats hash, the oldest
pending sample from the head of the pending index, the active run, a live rollout, the line's previous run end, an
operator pause), lets `eligibility.choose` pick the lines to start, and starts each through `TrainingRunner.start`,
the very path of `POST /v1/rl/training/runs` (claims stay O(batch); runs are recorded and executed alike), with the
run's `trigger`. Automatic runs are started for the `default` lineage's line only (`lines()`): choosing among
thousands of lineages' lines without reading them all needs the waiting-line hint of docs/lineages.md, not built
yet. The operator view, pause and resume work for every registered lineage (`resolve`).
Reading a line costs a fixed handful of commands: no scan of samples or of lines.
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

from ...common.ids import policy_lag_version
from ...common.lineage import DEFAULT_LINEAGE, is_lineage, line_of
from ...common.policy_names import BASE_POLICY
from ..background import stop_loop
from ..errors import DomainError, NotFound
from ..store import keys
from ..store.codec import text
from ..store.sample_status import SampleStatus
from ..store.trajectories import TrajectoryStore, stale_pending
from .eligibility import LineState, Verdict, choose, judge_line
from .models import TrainingRun
from .pauses import LineagePauses
from .policy import TrainingPolicyConfig
from .runs import RunStore

if TYPE_CHECKING:
    from ..rollout.controller import RolloutController
    from .runner import TrainingRunner

log = logging.getLogger("openjiuwen.agent_rl.online.training.scheduler")


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
        policy: TrainingPolicyConfig,
        model_id: str,
        max_policy_lag: int | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._runs = runs
        self._runner = runner
        self._store = store
        self._rollout = rollout
        self._pauses = pauses
        self._policy = policy
        self._model_id = model_id
        self._max_policy_lag = max_policy_lag
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    @property
    def policy(self) -> TrainingPolicyConfig:
        return self._policy

    def lines(self) -> list[tuple[str, str]]:
        """(line, lineage) of every line the scheduler starts runs for: the default lineage's only (see above)."""
        return [(self._model_id, DEFAULT_LINEAGE)]

    async def resolve(self, lineage: str) -> str:
        """The line of `lineage` when it exists (`default`, or registered by its first Task), else UnknownLineage."""
        if is_lineage(lineage) and (lineage == DEFAULT_LINEAGE
                                    or await self._redis.zscore(keys.LINEAGES, lineage) is not None):
            return line_of(self._model_id, lineage)
        raise UnknownLineage(f"lineage {lineage!r} does not exist")

    # ------------------------------------------------------------------ snapshot

    async def snapshot(self, line: str, lineage: str) -> LineState:
        store = self._store.for_line(line)  # the line's own pending index and counters
        async with self._redis.pipeline(transaction=False) as reads:
            reads.hgetall(store.stats_key)
            reads.zrange(store.index_key(SampleStatus.PENDING), 0, 0, withscores=True)
            reads.get(keys.POLICY_OBSERVED)
            raw_stats, head, observed = await reads.execute()
        counters = {(text(k) or ""): int(v) for k, v in raw_stats.items()}
        pending = max(0, counters.get(f"status:{SampleStatus.PENDING}", 0))
        # `policy:observed` is the default line's: another line's staleness is left to its run's claim.
        stale = 0 if lineage != DEFAULT_LINEAGE else stale_pending(
            counters, model_id=self._model_id, current_version=self._observed_version(observed),
            max_policy_lag=self._max_policy_lag)
        active = await self._runs.active()
        live = await self._rollout.in_progress() if self._rollout is not None else None
        return LineState(
            line=line,
            lineage=lineage,
            pending=pending,
            eligible=max(0, pending - stale),
            oldest_at=float(head[0][1]) if head else None,
            last_end_at=await self._runs.last_end(line),
            active_run=None if active is None else active.training_run_id,
            rollout_deciding=live is not None,
            paused=await self._pauses.get(lineage) is not None,
        )

    def _observed_version(self, observed: bytes | None) -> int:
        # The policy the runner last read from the gateway; the claim re-reads it, this only estimates staleness.
        name = BASE_POLICY
        if observed is not None:
            with suppress(orjson.JSONDecodeError, AttributeError):
                name = str(orjson.loads(observed).get("lora_name") or BASE_POLICY)
        return policy_lag_version(name, self._model_id)

    # ------------------------------------------------------------------ one tick

    async def tick(self) -> list[TrainingRun]:
        """Start what the policy says should start now; returns the runs created."""
        if not self._policy.auto:
            return []
        states = {state.line: state for state in [await self.snapshot(line, name) for line, name in self.lines()]}
        # Machine-wide: every active run counts, whichever line it trains.
        active = sum(1 for state in states.values() if state.active_run is not None)
        started = []
        for verdict in choose(states.values(), self._policy, self._clock(), active_runs=active):
            run = await self._start(states[verdict.line], verdict)
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
            run, created = await self._runner.start(trigger=trigger, min_samples=verdict.min_samples)
        except DomainError as exc:  # fewer samples at claim time, a rollout that just began, the gateway down
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
            "training_policy": self._policy.model_dump(),
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
        if not self._policy.auto:
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
