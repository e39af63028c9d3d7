"""This process's executions of Training Runs (CONTRACT §4.7 `queued` → `training` → `activating`): one asyncio task
per live run that awaits `backend.train` (a child process or Ray, never the event loop), records its progress and
outcome, and hands a trained run to its activation (run_activation.py).

Every write of a run's outcome is durable through a Redis outage (durable_writes.py). A write refused because this
worker's term is over (`LeaseLost`) ends the execution without settling anything: the next leader's recovery does.
A run whose record vanished is abandoned: its batch goes back to pending.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import faults
from ...common.ids import now_iso, parse_iso_epoch
from ..lora.repository import Artifact, LoraRepository
from ..store.sample_documents import SampleDocuments
from ..store.fence import LeaseLost
from .backends import PLACEMENT, TrainerBackend, TrainingJob
from .durable_writes import REDIS_DOWN, DurableWrites
from .run_activation import RunActivation
from .run_records import RunStage, RunStatus, TrainingRun
from .run_reads import RunReads
from .run_transitions import RunNotFound, RunTransitions

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics

log = logging.getLogger("openjiuwen.agent_rl.online.training")


class RunExecutions:
    def __init__(
        self,
        runs: RunTransitions,
        run_reads: RunReads,
        documents: SampleDocuments,
        backend: TrainerBackend,
        repository: LoraRepository,
        activation: RunActivation,
        durable: DurableWrites,
        *,
        model_id: str,
        base_model_path: str,
        tmp_root: str | Path,
        metrics: "ServiceMetrics | None" = None,
    ) -> None:
        self._runs = runs
        self._run_reads = run_reads
        self._documents = documents
        self._backend = backend
        self._repository = repository
        self._activation = activation
        self._durable = durable
        self._model_id = model_id
        self._base_model_path = base_model_path
        self._tmp_root = Path(tmp_root)
        self._metrics = metrics
        self._tasks: dict[str, asyncio.Task[None]] = {}  # run id → its execution
        self._claim_checks: set[asyncio.Task[None]] = set()  # claims whose EXEC answer was lost (settle_lost_claim)
        self._stop_requested: set[str] = set()
        self._failure: str | None = None

    # ------------------------------------------------------------------ what the runner asks

    def task(self, run_id: str) -> asyncio.Task[None] | None:
        """The run's execution in this process, if it has one."""
        return self._tasks.get(run_id)

    async def end(self, run_id: str, *, cancel: bool) -> None:
        """Wait for the run's execution in this process to end, cancelling it first when `cancel` (a stop the backend
        could not deliver). Nothing to wait for without one."""
        task = self._tasks.get(run_id)
        if task is None:
            return
        if cancel and not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def run_ids(self) -> list[str]:
        return list(self._tasks)

    def request_stop(self, run_id: str) -> None:
        """A stop was asked: a training that ends now counts as canceled, and a trained run is not activated."""
        self._stop_requested.add(run_id)

    def check_health(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)

    async def cancel_claim_checks(self) -> None:
        for check in list(self._claim_checks):
            check.cancel()
        await asyncio.gather(*self._claim_checks, return_exceptions=True)

    async def cancel_all(self) -> None:
        """Cancel every execution and claim check of this process without settling a record (a cancelled execution
        writes nothing; the local backend kills its trainer on the way)."""
        running = [*self._claim_checks, *self._tasks.values()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def adopt(self, run: TrainingRun) -> None:
        """Launch a queued run that no execution of this process owns: a claim whose answer was lost. (Startup
        recovery settles queued runs before the service serves, so every other queued run has its execution.)"""
        if run.stage == RunStage.QUEUED and not run.terminal and run.training_run_id not in self._tasks:
            log.warning("training run %s was claimed without an execution; launching it", run.training_run_id,
                        extra={"training_run_id": run.training_run_id})
            self.launch(run)

    def settle_lost_claim(self, run_id: str) -> None:
        async def settle() -> None:
            run = await self._durable(f"run {run_id} claim outcome", lambda: self._run_reads.get(run_id))
            if run is not None:
                self.adopt(run)

        task = asyncio.create_task(settle(), name=f"training-run-claim:{run_id}")
        self._claim_checks.add(task)
        task.add_done_callback(self._claim_checks.discard)

    def launch(self, run: TrainingRun) -> None:
        run_id = run.training_run_id
        task = asyncio.create_task(self._execute(run), name=f"training-run:{run_id}")
        self._tasks[run_id] = task

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.pop(run_id, None)
            self._stop_requested.discard(run_id)
            if not t.cancelled() and t.exception() is not None:
                # Sticky until restart: the run's state may be inconsistent with what this process believes.
                self._failure = f"training run {run_id} execution failed: {t.exception()!r}"
                log.error("training run %s execution failed", run_id, exc_info=t.exception(),
                          extra={"training_run_id": run_id})

        task.add_done_callback(done)

    async def abandon(self, run: TrainingRun) -> None:
        run_id = run.training_run_id
        restored = await asyncio.shield(self._durable(f"run {run_id} abandon", lambda: self._runs.abandon(run)))
        log.warning("training run %s: its record vanished; %d sample(s) back to pending", run_id, restored,
                    extra={"training_run_id": run_id})
        await self.cleanup(run_id)

    async def cleanup(self, run_id: str) -> None:
        await self._repository.remove_temp(run_id)
        await asyncio.to_thread(self._remove_tmp_dirs, run_id)

    # ------------------------------------------------------------------ one execution

    async def _execute(self, run: TrainingRun) -> None:
        try:
            try:
                await self._execute_steps(run)
            except RunNotFound:
                # Nothing is left to record progress or an outcome in. Failing the task would make /health report a
                # sticky failure until a restart and leave the batch claimed; releasing it lets the next run claim.
                await self.abandon(run)
        except LeaseLost as exc:
            # Not a failure of the run: this worker is no longer the leader. Nothing more is written or removed
            # here; the next leader's recovery settles the run and its temporary files.
            log.warning("training run %s: execution stopped, %s", run.training_run_id, exc,
                        extra={"training_run_id": run.training_run_id})

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
            await self.cleanup(run_id)
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
        await self._activation.activate(run)

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
            except REDIS_DOWN as exc:  # progress is informational: a lost step never fails the training
                log.warning("run %s: progress step not recorded (%s)", run_id, exc)
            except LeaseLost as exc:
                # Deposed mid-training: cancel the execution, as a relinquish would (every backend kills its
                # trainer on cancellation, which it sees at its next await); nothing more of this run is written.
                log.warning("run %s: progress step refused (%s); stopping the execution", run_id, exc)
                execution = self._tasks.get(run_id)
                if execution is not None:
                    execution.cancel()

        return record

    def _stage(self, stage: str, outcome: str, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.stage(stage, outcome, seconds)

    def _remove_tmp_dirs(self, run_id: str) -> None:
        if self._tmp_root.is_dir():
            for entry in self._tmp_root.glob(f"{run_id}*"):
                shutil.rmtree(entry, ignore_errors=True)
