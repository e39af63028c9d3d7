"""The Training Runner: Training Runs from claim to activation (CONTRACT §4.7, D2–D4, D11), at most one live run per
lineage and `training_policy.max_concurrent_runs` together (training/run_claims.py, invariant 6 per line).

```
 start ─▶ pending/queued ─▶ running/training ─▶ running/activating ─▶ succeeded
             │                  │   │                 │   │
             │ stop             │   │ failure         │   └─ activation failed ─▶ failed (samples stay trained)
             ▼                  ▼   ▼                 ▼
          canceled ◀──── stop ──┘  failed          stop: gateway switched? ─▶ succeeded | canceled
   (samples back to pending for canceled/failed before `activating`)
```
Training runs in the backend (a child process or Ray), never on the event loop; this class only awaits it, one
execution (an asyncio task) per live run, so up to `max_concurrent_runs` `backend.train` calls run at once, each for
a different lineage.

Only the leader runs this (workers/): every write of a run goes through its fence, and a write refused because its
term is over (`LeaseLost`) ends the execution without settling anything — the next leader's `recover` does.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import Conflict, DomainError, NotFound
from .. import faults
from ...common.ids import now_iso, parse_iso_epoch, policy_lag_version
from ...common.lineage import DEFAULT_LINEAGE, line_of
from ..lora.gateway_client import GatewayError, GatewayLoraClient
from ..lora.repository import Artifact, LoraRepository
from ..store.sample_documents import SampleDocuments
from ..store.fence import LeaseLost
from .backends import PLACEMENT, TrainerBackend, TrainingJob
from .freshness import ACTIVATION, Freshness
from .training_policy import TrainingPolicyConfig
from .run_records import RunStage, RunStatus, TrainingRun, empty_metrics, manual_trigger, new_run_id
from .run_claims import RunClaims
from .run_reads import RunReads
from .run_transitions import RunNotFound, RunTransitions

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics
    from ..rollout.controller import RolloutController

log = logging.getLogger("openjiuwen.agent_rl.online.training")

T = TypeVar("T")
# A run's own state writes outlive a Redis outage of up to this long (then the execution fails for good and health
# reports it); the backoff between tries doubles from 0.1 s up to 2 s.
REDIS_OUTAGE_S = 600.0
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)

class GatewayUnavailable(DomainError):
    """The active policy could not be read from the gateway at run start (502, no run created)."""


class TrainingRunner:
    def __init__(
        self,
        runs: RunTransitions,
        documents: SampleDocuments,
        backend: TrainerBackend,
        repository: LoraRepository,
        gateway: GatewayLoraClient,
        *,
        claims: RunClaims,
        run_reads: RunReads,
        model_id: str,
        base_model_path: str,
        min_samples: int,
        max_samples: int,
        max_policy_lag: int | None,
        tmp_root: str | Path,
        metrics: "ServiceMetrics | None" = None,
        redis_outage_s: float = REDIS_OUTAGE_S,
        rollout: "RolloutController | None" = None,
        policy: TrainingPolicyConfig | None = None,
        freshness: Freshness | None = None,
    ) -> None:
        self._runs = runs
        self._claims = claims
        self._run_reads = run_reads
        self._documents = documents
        self._backend = backend
        self._repository = repository
        self._gateway = gateway
        self._model_id = model_id
        self._base_model_path = base_model_path
        self._min_samples = min_samples
        self._max_samples = max_samples
        self._max_policy_lag = max_policy_lag
        self._tmp_root = Path(tmp_root)
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self._executions: dict[str, asyncio.Task[None]] = {}
        self._claim_checks: set[asyncio.Task[None]] = set()  # claims whose EXEC answer was lost (_settle_lost_claim)
        self._stop_requested: set[str] = set()
        self._failure: str | None = None
        self._redis_outage_s = redis_outage_s
        self._rollout = rollout  # canary / manual: a new version becomes the candidate, not the active one
        # The machine-wide room, and each lineage's fair-share weight and batch cap (training/training_policy.py).
        self._policy = policy or TrainingPolicyConfig()
        self._freshness = freshness

    # ------------------------------------------------------------------ API

    async def list_runs(self, limit: int, cursor: str | None, lineage: str | None = None) -> dict[str, Any]:
        return await self._run_reads.list_page(limit, cursor, lineage)

    async def events(self, run_id: str) -> list[dict[str, Any]]:
        items = await self._run_reads.events(run_id)
        if items is None:
            raise NotFound("training run not found")
        return items

    async def get(self, run_id: str) -> TrainingRun:
        run = await self._run_reads.get(run_id)
        if run is None:
            raise RunNotFound(run_id)
        return run

    async def start(
        self, *, trigger: dict[str, Any] | None = None, min_samples: int | None = None,
        lineage: str = DEFAULT_LINEAGE,
    ) -> tuple[TrainingRun, bool]:
        """Return the lineage's live run, or claim a fixed batch and launch a new one: (record, created). The manual
        route and the automatic scheduler both come here; the scheduler passes its `trigger` (recorded on the run)
        and the smallest batch its reason allows (`min_samples`, capped by `max_samples_per_run` and the lineage's
        own cap). `lineage`: the line it trains (docs/lineages.md): its own pending samples, from its active
        version, to its next `<line>:vN`.

        At most one live run per lineage and `max_concurrent_runs` together (training/run_claims.py): a start of another
        lineage while that many are live is a Conflict `training_run_conflict`."""
        trigger = trigger or manual_trigger()
        line = line_of(self._model_id, lineage)
        policy = self._policy.for_lineage(lineage)
        cap = min(self._max_samples, policy.max_samples_per_run or self._max_samples)
        minimum = min(self._min_samples if min_samples is None else min_samples, cap)
        room = self._policy.max_concurrent_runs
        async with self._lock:
            live = await self._run_reads.active_runs()
            for run in live:
                self._adopt(run)
            mine = next((run for run in live if run.lineage == lineage), None)
            if mine is not None:
                return mine, False
            if len(live) >= room:
                raise self._full(live)
            if self._rollout is not None and (current := await self._rollout.in_progress(line)) is not None:
                # Never two candidates on a line, and a run trained while its line's candidate is judged would
                # have an undecided parent. Other lines' rollouts do not hold this one.
                raise Conflict(f"rollout {current.rollout_id} ({current.status}) is in progress: a new "
                               "Training Run starts once it is promoted or rolled back", code="rollout_in_progress")
            try:
                parent = await self._gateway.read_policy(line)
            except GatewayError as exc:
                raise GatewayUnavailable(f"cannot read the active policy from the gateway: {exc}") from exc
            # Every line's observed policy (the default line's is the AIGW key `policy:observed`): the scheduler
            # judges the line's stale samples against it, as this claim does against `parent`.
            await self._runs.observe_policy(parent.lora_name, parent.lora_path, line=line)
            parent_version = policy_lag_version(parent.lora_name, line)
            # Samples lagging the parent past `max_policy_lag` would never be claimed: they leave `pending` first.
            await self._claims.retire_outdated(line, current_version=parent_version,
                                             max_policy_lag=self._max_policy_lag)
            draft = TrainingRun(
                training_run_id=new_run_id(),
                status=RunStatus.PENDING.value,
                stage=RunStage.QUEUED.value,
                sample_count=0,
                policy_versions={},
                created_at=now_iso(),
                metrics=empty_metrics(),
                parent_lora_name=parent.lora_name,
                parent_lora_path=parent.lora_path,
                trigger=trigger,
                lineage=lineage,
            )
            try:
                claim = await self._claims.claim(
                    draft,
                    parent_version=parent_version,
                    max_policy_lag=self._max_policy_lag,
                    min_samples=minimum,
                    max_samples=cap,
                    max_active=room,
                    share_cost=1.0 / policy.weight,
                )
            except _REDIS_DOWN:
                # Redis may have applied the claim's EXEC and lost only its answer: the run would then sit queued
                # with its batch claimed and nothing executing it. Look again once Redis answers.
                self._settle_lost_claim(draft.training_run_id)
                raise
            if claim.existing:
                assert claim.run is not None
                return claim.run, False
            if claim.busy:
                raise self._full(list(claim.busy))
            if claim.run is None:
                raise Conflict(
                    f"pending samples {claim.eligible} is below minimum {minimum}",
                    code="insufficient_samples",
                )
            faults.reached("run.claimed")
            if self._metrics is not None:
                self._metrics.run_started(str(trigger.get("kind")))
                self._metrics.run_claimed(lineage, (claim.run.freshness or {}).get("eligible_wait_seconds"))
            self._launch(claim.run)
            log.info("training run %s claimed %d sample(s) of %s on parent %s", claim.run.training_run_id,
                     claim.run.sample_count, line, parent.lora_name,
                     extra={"training_run_id": claim.run.training_run_id})
            return claim.run, True

    def _full(self, live: list[TrainingRun]) -> Conflict:
        names = ", ".join(f"{run.training_run_id} ({run.lineage})" for run in live)
        if len(live) < self._policy.max_concurrent_runs:  # room, but the default pointer names another lineage's run
            return Conflict(f"the default lineage's pointer names a live run of another lineage, written before runs "
                            f"were concurrent ({names}): the default lineage starts once it ends",
                            code="training_run_conflict")
        return Conflict(f"{len(live)} Training Run(s) live ({names}): at most "
                        f"{self._policy.max_concurrent_runs} at a time on this service (max_concurrent_runs)",
                        code="training_run_conflict")

    async def stop(self, run_id: str) -> TrainingRun:
        """Cancel a run and return its record once settled; the record tells the truth (D4). A record that
        vanishes meanwhile is NotFound (404) and its batch is released."""
        run = await self.get(run_id)
        if run.terminal:
            return run
        try:
            return await self._stop(run)
        except RunNotFound:
            await self._abandon(run)
            raise

    async def _stop(self, run: TrainingRun) -> TrainingRun:
        run_id = run.training_run_id
        self._stop_requested.add(run_id)
        await self._runs.append_event(run_id, "stop_requested", {"stage": run.stage})
        task = self._executions.get(run_id)
        if run.stage in (RunStage.QUEUED, RunStage.TRAINING):
            stopped = await self._backend.cancel(run_id)
            if task is not None:
                if not stopped:
                    task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            run = await self.get(run_id)
            if not run.terminal and run.stage != RunStage.ACTIVATING:
                run = await self._runs.finish(run_id, RunStatus.CANCELED, restore_samples=True)
                await self._cleanup(run_id)
                return run
        if not run.terminal:
            return await self._stop_activation(run_id, task)
        return run

    async def recover(self) -> list[TrainingRun]:
        """Startup or takeover: settle every live run (CONTRACT §4.7 Recover), each independently and at once (an
        activation retried for one line does not hold the others' batches), and return them settled."""
        outcomes = await asyncio.gather(*(self._recover_one(run) for run in await self._run_reads.active_runs()),
                                        return_exceptions=True)
        for outcome in outcomes:  # every recovery ran to its end; then the first failure (LeaseLost, Redis) is raised
            if isinstance(outcome, BaseException):
                raise outcome
        return [run for run in outcomes if isinstance(run, TrainingRun)]

    async def _recover_one(self, run: TrainingRun) -> TrainingRun | None:
        try:
            return await self._recover(run)
        except RunNotFound:
            await self._abandon(run)
            return None

    async def _recover(self, run: TrainingRun) -> TrainingRun:
        await self._runs.append_event(run.training_run_id, "recovered", {"stage": run.stage})
        if run.stage in (RunStage.QUEUED, RunStage.TRAINING):
            log.warning("training run %s was interrupted by a restart; its samples go back to pending",
                        run.training_run_id, extra={"training_run_id": run.training_run_id})
            run = await self._runs.finish(
                run.training_run_id, RunStatus.FAILED, failure_reason="service_restarted", restore_samples=True
            )
            await self._cleanup(run.training_run_id)
            return run
        log.info("training run %s was activating at restart; retrying the activation", run.training_run_id,
                 extra={"training_run_id": run.training_run_id})
        return await self._activate(run)

    async def shutdown(self) -> None:
        """Stop the active run of this process as `POST .../stop` would."""
        for check in list(self._claim_checks):
            check.cancel()
        await asyncio.gather(*self._claim_checks, return_exceptions=True)
        for run_id in list(self._executions):
            try:
                await self.stop(run_id)
            except LeaseLost as exc:
                log.warning("training run %s left to the next leader at shutdown: %s", run_id, exc,
                            extra={"training_run_id": run_id})
            except Exception:
                log.exception("training run %s could not be stopped at shutdown", run_id,
                              extra={"training_run_id": run_id})

    async def relinquish(self) -> None:
        """This worker lost the leader lease (workers/coordinator.py): stop every execution of this process without
        settling its record. The next leader's takeover recovery settles it (`recover`); a settle from here could
        race that. A cancelled execution writes nothing (the local backend kills its trainer on the way)."""
        running = [*self._claim_checks, *self._executions.values()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def check_health(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        self._backend.check_health()

    # ------------------------------------------------------------ execution

    def _adopt(self, run: TrainingRun) -> None:
        """Launch a queued run that no execution of this process owns: a claim whose answer was lost. (Startup
        recovery settles queued runs before the service serves, so every other queued run has its execution.)"""
        if run.stage == RunStage.QUEUED and not run.terminal and run.training_run_id not in self._executions:
            log.warning("training run %s was claimed without an execution; launching it", run.training_run_id,
                        extra={"training_run_id": run.training_run_id})
            self._launch(run)

    def _settle_lost_claim(self, run_id: str) -> None:
        async def settle() -> None:
            run = await self._durable(f"run {run_id} claim outcome", lambda: self._run_reads.get(run_id))
            if run is not None:
                self._adopt(run)

        task = asyncio.create_task(settle(), name=f"training-run-claim:{run_id}")
        self._claim_checks.add(task)
        task.add_done_callback(self._claim_checks.discard)

    def _launch(self, run: TrainingRun) -> None:
        run_id = run.training_run_id
        task = asyncio.create_task(self._execute(run), name=f"training-run:{run_id}")
        self._executions[run_id] = task

        def done(t: asyncio.Task[None]) -> None:
            self._executions.pop(run_id, None)
            self._stop_requested.discard(run_id)
            if not t.cancelled() and t.exception() is not None:
                # Sticky until restart: the run's state may be inconsistent with what this process believes.
                self._failure = f"training run {run_id} execution failed: {t.exception()!r}"
                log.error("training run %s execution failed", run_id, exc_info=t.exception(),
                          extra={"training_run_id": run_id})

        task.add_done_callback(done)

    async def _durable(self, what: str, write: Callable[[], Awaitable[T]]) -> T:
        """Run one state write of a run's execution, retried while Redis is unreachable: an execution that gave up
        on a blip would leave its run non-terminal with its batch claimed until a restart. Every write it wraps is
        idempotent (a terminal record is returned unchanged, a repeated move finds nothing left to move), so a try
        that Redis applied although its answer was lost is harmless to repeat."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._redis_outage_s
        delay = 0.1
        while True:
            try:
                return await write()
            except _REDIS_DOWN as exc:
                if loop.time() + delay > deadline:
                    raise
                log.warning("%s: Redis unavailable (%s); retrying in %.1f s", what, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _execute(self, run: TrainingRun) -> None:
        try:
            try:
                await self._execute_steps(run)
            except RunNotFound:
                # Nothing is left to record progress or an outcome in. Failing the task would make /health report a
                # sticky failure until a restart and leave the batch claimed; releasing it lets the next run claim.
                await self._abandon(run)
        except LeaseLost as exc:
            # Not a failure of the run: this worker is no longer the leader. Nothing more is written or removed
            # here; the next leader's recovery settles the run and its temporary files.
            log.warning("training run %s: execution stopped, %s", run.training_run_id, exc,
                        extra={"training_run_id": run.training_run_id})

    async def _abandon(self, run: TrainingRun) -> None:
        run_id = run.training_run_id
        restored = await asyncio.shield(self._durable(f"run {run_id} abandon", lambda: self._runs.abandon(run)))
        log.warning("training run %s: its record vanished; %d sample(s) back to pending", run_id, restored,
                    extra={"training_run_id": run_id})
        await self._cleanup(run_id)

    async def _execute_steps(self, run: TrainingRun) -> None:
        run_id = run.training_run_id
        run = await self._durable(f"run {run_id} start", lambda: self._runs.update(
            run_id,
            lambda r: r.evolve(status=RunStatus.RUNNING.value, stage=RunStage.TRAINING.value, started_at=now_iso()),
            event=("training_started", {}),
        ))
        if run.terminal:
            return
        if run.started_at:
            self._stage("queued", "ok", parse_iso_epoch(run.started_at) - parse_iso_epoch(run.created_at))
        started = time.perf_counter()
        try:
            samples = await self._documents.get_documents(run.sample_ids)
            job = TrainingJob(
                training_run_id=run_id,
                model_id=self._model_id,
                base_model_path=self._base_model_path,
                samples=samples,
                init_lora_name=run.parent_lora_name,
                init_lora_path=run.parent_lora_path,
                line=run.line(self._model_id),
            )
            artifact = await self._backend.train(job, on_progress=self._progress_recorder(run_id))
            await asyncio.to_thread(self._repository.for_line(run.line(self._model_id)).validate_artifact, artifact)
            faults.reached("run.trained")
        except asyncio.CancelledError:
            self._stage("training", "canceled", time.perf_counter() - started)
            raise  # `stop` settles the record
        except Exception as exc:
            canceled = run_id in self._stop_requested
            self._stage("training", "canceled" if canceled else "failed", time.perf_counter() - started)
            reason = None if canceled else (str(exc) or type(exc).__name__)
            if not canceled:
                log.warning("training run %s failed: %s", run_id, reason, extra={"training_run_id": run_id})
            status = RunStatus.CANCELED if canceled else RunStatus.FAILED
            await asyncio.shield(self._durable(f"run {run_id} {status.value}", lambda: self._runs.finish(
                run_id, status, failure_reason=reason, restore_samples=True,
            )))
            await self._cleanup(run_id)
            return
        self._stage("training", "ok", time.perf_counter() - started)
        run = await asyncio.shield(self._durable(f"run {run_id} trained", lambda: self._mark_trained(run_id, artifact)))
        if self._metrics is not None and artifact.metadata.get("sampling"):
            self._metrics.run_sampling(artifact.metadata["sampling"])
        if run.terminal:
            return
        if run_id in self._stop_requested:
            # Stop arrived as training completed: the artifact and the trained samples stay, nothing is activated.
            await asyncio.shield(
                self._durable(f"run {run_id} canceled", lambda: self._runs.finish(run_id, RunStatus.CANCELED))
            )
            return
        faults.reached("run.marked")
        await self._activate(run)

    async def _mark_trained(self, run_id: str, artifact: Artifact) -> TrainingRun:
        meta = artifact.metadata
        patch = {
            k: meta[k] for k in ("dropped_samples", "prompt_truncated_samples", "response_truncated_samples",
                                 "sampling", "constraints", "timings")
            if meta.get(k) is not None
        }
        return await self._runs.mark_trained(
            run_id, lora_name=artifact.lora_name, lora_path=artifact.lora_path,
            dropped_ids=list(meta.get("dropped_sample_ids") or []), metrics_patch=patch,
        )

    @staticmethod
    def _step_change(step: dict[str, Any]) -> Callable[[TrainingRun], TrainingRun]:
        def change(run: TrainingRun) -> TrainingRun:
            metrics = dict(run.metrics)
            metrics["step_metrics"] = list(metrics.get("step_metrics", [])) + [step]
            metrics["steps"] = len(metrics["step_metrics"])
            for key in ("dropped_samples", "prompt_truncated_samples", "response_truncated_samples"):
                if key in step:
                    metrics[key] = step[key]
            return run.evolve(metrics=metrics)

        return change

    def _progress_recorder(self, run_id: str) -> Callable[[dict[str, Any]], Any]:
        async def record(step: dict[str, Any]) -> None:
            if PLACEMENT in step:  # where the run stands in getting its resources: no step (backends/__init__.py)
                note = dict(step[PLACEMENT])

                def place(run: TrainingRun) -> TrainingRun:
                    return run.evolve(metrics={**run.metrics, PLACEMENT: note})

                kind = "resources_placed" if note.get("state") == "placed" else "waiting_for_resources"
                change, event = place, (kind, note)
            else:
                change, event = self._step_change(step), ("ppo_step", step)
            try:
                await self._runs.update(run_id, change, event=event)
            except _REDIS_DOWN as exc:  # progress is informational: a lost step never fails the training
                log.warning("run %s: progress step not recorded (%s)", run_id, exc)
            except LeaseLost as exc:
                # Deposed mid-training: cancel the execution, as a relinquish would (every backend kills its
                # trainer on cancellation, which it sees at its next await); nothing more of this run is written.
                log.warning("run %s: progress step refused (%s); stopping the execution", run_id, exc)
                execution = self._executions.get(run_id)
                if execution is not None:
                    execution.cancel()

        return record

    async def _activate(self, run: TrainingRun) -> TrainingRun:
        assert run.lora_name and run.lora_path
        if self._rollout is not None and self._rollout.gated:
            return await self._begin_canary(run)
        await self._runs.append_event(run.training_run_id, "activation_attempt", {
            "lora_name": run.lora_name, "expected_lora_name": run.parent_lora_name,
        })
        started = time.perf_counter()
        try:
            await self._gateway.activate(
                base_model=self._base_model_path, lora_name=run.lora_name, lora_path=run.lora_path,
                expected=run.parent_lora_name, run_id=run.training_run_id,
            )
        except asyncio.CancelledError:
            self._activation_done("canceled", time.perf_counter() - started)
            raise
        except GatewayError as exc:
            self._activation_done("failed", time.perf_counter() - started)
            log.warning("activation of %s failed: %s", run.lora_name, exc,
                        extra={"training_run_id": run.training_run_id, "lora_name": run.lora_name})
            # Bound here: a shielded write may outlive this `except` (a cancelled caller), which unbinds `exc`.
            error = str(exc)
            return await asyncio.shield(self._durable(f"run {run.training_run_id} failed", lambda: self._runs.finish(
                run.training_run_id, RunStatus.FAILED, failure_reason=error,
                before=[("activation_failed", {"lora_name": run.lora_name, "error": error})],
            )))
        self._activation_done("ok", time.perf_counter() - started)
        faults.reached("run.activated")
        return await asyncio.shield(self._succeed(run))

    async def _begin_canary(self, run: TrainingRun) -> TrainingRun:
        """Canary / manual rollout: the version becomes the gateway's candidate; the run succeeds with it (what
        becomes of the version is the rollout's story, in both timelines)."""
        assert self._rollout is not None
        run_id = run.training_run_id
        await self._runs.append_event(run_id, "activation_attempt", {
            "lora_name": run.lora_name, "expected_lora_name": run.parent_lora_name, "as": "candidate",
        })
        started = time.perf_counter()
        try:
            record = await self._rollout.begin(run)
        except asyncio.CancelledError:
            self._activation_done("canceled", time.perf_counter() - started)
            raise
        except (GatewayError, Conflict) as exc:
            self._activation_done("failed", time.perf_counter() - started)
            log.warning("canary of %s could not start: %s", run.lora_name, exc,
                        extra={"training_run_id": run_id, "lora_name": run.lora_name})
            error = str(exc)  # bound here: the shielded write may outlive this `except`
            return await asyncio.shield(self._durable(f"run {run_id} failed", lambda: self._runs.finish(
                run_id, RunStatus.FAILED, failure_reason=error,
                before=[("activation_failed", {"lora_name": run.lora_name, "error": error})],
            )))
        self._activation_done("ok", time.perf_counter() - started)
        log.info("training run %s succeeded: %s is the candidate of rollout %s", run_id, run.lora_name,
                 record.rollout_id, extra={"training_run_id": run_id, "lora_name": run.lora_name})
        return await asyncio.shield(self._durable(f"run {run_id} succeeded", lambda: self._runs.finish(
            run_id, RunStatus.SUCCEEDED,
            before=[("candidate_loaded", {"lora_name": run.lora_name, "rollout_id": record.rollout_id})],
        )))

    def _stage(self, stage: str, outcome: str, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.stage(stage, outcome, seconds)

    def _activation_done(self, outcome: str, seconds: float) -> None:
        self._stage("activating", outcome, seconds)
        if self._metrics is not None:
            self._metrics.activation(outcome, seconds)

    async def _succeed(self, run: TrainingRun) -> TrainingRun:
        assert run.lora_name and run.lora_path
        run_id = run.training_run_id
        # The fenced write first, on every line (the default line's observed policy is the AIGW key, another
        # line's is its field of `policy:observed_lines`): a deposed leader stops before it writes the repository's
        # marker (a file carries no token; the next leader, activating the same artifact again, writes the same).
        line = run.line(self._model_id)
        await self._durable(f"run {run_id} policy",
                            lambda: self._runs.observe_policy(run.lora_name, run.lora_path, line=line))
        await self._repository.for_line(line).write_active(run.lora_name, run.lora_path, run_id)
        log.info("training run %s succeeded: %s active", run_id, run.lora_name,
                 extra={"training_run_id": run_id, "lora_name": run.lora_name})
        fresh = await self._measure_freshness(run)
        return await self._durable(f"run {run_id} succeeded", lambda: self._runs.finish(
            run_id, RunStatus.SUCCEEDED, before=[("activation_succeeded", {"lora_name": run.lora_name})],
            freshness=fresh,
        ))

    async def _measure_freshness(self, run: TrainingRun) -> dict[str, Any] | None:
        """The version is the line's policy from now: its samples' sample-to-policy latency (a measurement: a
        Redis blip loses it, never the run's success)."""
        if self._freshness is None:
            return None
        try:
            return await self._freshness.measure(run, at=time.time(), via=ACTIVATION)
        except _REDIS_DOWN as exc:
            log.warning("run %s: freshness not measured (%s)", run.training_run_id, exc)
            return None

    async def _stop_activation(self, run_id: str, task: asyncio.Task[None] | None) -> TrainingRun:
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        run = await self.get(run_id)
        if run.terminal:
            return run
        if self._rollout is not None and self._rollout.gated:
            return await self._stop_canary_start(run)
        try:
            policy = await self._gateway.read_policy_retrying(line=run.line(self._model_id))
        except GatewayError as exc:
            return await self._runs.finish(
                run_id, RunStatus.CANCELED, failure_reason=f"activation outcome unknown: {exc}"
            )
        if policy.lora_name == run.lora_name:
            return await self._succeed(run)
        return await self._runs.finish(run_id, RunStatus.CANCELED)

    async def _stop_canary_start(self, run: TrainingRun) -> TrainingRun:
        """A stop while the version was becoming the candidate: a canary that got its record goes on (the run
        succeeded); otherwise the gateway's candidate, if it got that far, is dropped so that no candidate is left
        without a rollout."""
        assert self._rollout is not None and run.lora_name
        record = await self._rollout.record_of(run)
        if record is not None:
            return await self._runs.finish(run.training_run_id, RunStatus.SUCCEEDED, before=[
                ("candidate_loaded", {"lora_name": run.lora_name, "rollout_id": record.rollout_id})])
        try:
            await self._gateway.abort_canary(base_model=self._base_model_path, lora_name=run.lora_name)
        except GatewayError as exc:
            return await self._runs.finish(run.training_run_id, RunStatus.CANCELED,
                                           failure_reason=f"candidate outcome unknown: {exc}")
        return await self._runs.finish(run.training_run_id, RunStatus.CANCELED)

    async def _cleanup(self, run_id: str) -> None:
        await self._repository.remove_temp(run_id)
        await asyncio.to_thread(self._remove_tmp_dirs, run_id)

    def _remove_tmp_dirs(self, run_id: str) -> None:
        if self._tmp_root.is_dir():
            for entry in self._tmp_root.glob(f"{run_id}*"):
                shutil.rmtree(entry, ignore_errors=True)
