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
Training runs in the backend (a child process or Ray), never on the event loop; one execution (an asyncio task,
run_executions.py) per live run awaits it, so up to `max_concurrent_runs` `backend.train` calls run at once, each for
a different lineage; a trained run's version goes live through run_activation.py. This class is the runs' public
face: start (the claim), stop, recover, get.

Only the leader runs this (workers/): every write of a run goes through its fence, and a write refused because its
term is over (`LeaseLost`) ends the execution without settling anything — the next leader's `recover` does.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ..errors import Conflict, DomainError, NotFound
from .. import faults
from ...common.ids import now_iso, policy_lag_version
from ...common.lineage import DEFAULT_LINEAGE, line_of
from ..lora.gateway_client import GatewayError, GatewayLoraClient
from ..store.fence import LeaseLost
from .backends import TrainerBackend
from .durable_writes import REDIS_DOWN
from .training_policy import TrainingPolicyConfig
from .run_activation import RunActivation
from .run_executions import RunExecutions
from .run_records import RunStage, RunStatus, TrainingRun, empty_metrics, manual_trigger, new_run_id
from .run_claims import RunClaims
from .run_reads import RunReads
from .run_transitions import RunNotFound, RunTransitions

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics
    from ..rollout.controller import RolloutController

log = logging.getLogger("openjiuwen.agent_rl.online.training")


class GatewayUnavailable(DomainError):
    """The active policy could not be read from the gateway at run start (502, no run created)."""


class TrainingRunner:
    def __init__(
        self,
        runs: RunTransitions,
        backend: TrainerBackend,
        gateway: GatewayLoraClient,
        *,
        claims: RunClaims,
        run_reads: RunReads,
        executions: RunExecutions,
        activation: RunActivation,
        model_id: str,
        min_samples: int,
        max_samples: int,
        max_policy_lag: int | None,
        metrics: "ServiceMetrics | None" = None,
        rollout: "RolloutController | None" = None,
        policy: TrainingPolicyConfig | None = None,
    ) -> None:
        self._runs = runs
        self._claims = claims
        self._run_reads = run_reads
        self._executions = executions
        self._activation = activation
        self._backend = backend
        self._gateway = gateway
        self._model_id = model_id
        self._min_samples = min_samples
        self._max_samples = max_samples
        self._max_policy_lag = max_policy_lag
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self._rollout = rollout  # canary / manual: a new version becomes the candidate, not the active one
        # The machine-wide room, and each lineage's fair-share weight and batch cap (training/training_policy.py).
        self._policy = policy or TrainingPolicyConfig()

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
                self._executions.adopt(run)
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
            except REDIS_DOWN:
                # Redis may have applied the claim's EXEC and lost only its answer: the run would then sit queued
                # with its batch claimed and nothing executing it. Look again once Redis answers.
                self._executions.settle_lost_claim(draft.training_run_id)
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
            self._executions.launch(claim.run)
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
            await self._executions.abandon(run)
            raise

    async def _stop(self, run: TrainingRun) -> TrainingRun:
        run_id = run.training_run_id
        self._executions.request_stop(run_id)
        await self._runs.append_event(run_id, "stop_requested", {"stage": run.stage})
        if run.stage in (RunStage.QUEUED, RunStage.TRAINING):
            stopped = await self._backend.cancel(run_id)
            await self._executions.end(run_id, cancel=not stopped)
            run = await self.get(run_id)
            if not run.terminal and run.stage != RunStage.ACTIVATING:
                run = await self._runs.finish(run_id, RunStatus.CANCELED, restore_samples=True)
                await self._executions.cleanup(run_id)
                return run
        if not run.terminal:  # activating: once its execution is over, the gateway tells what happened
            await self._executions.end(run_id, cancel=True)
            run = await self.get(run_id)
            if not run.terminal:
                return await self._activation.stop(run)
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
            await self._executions.abandon(run)
            return None

    async def _recover(self, run: TrainingRun) -> TrainingRun:
        await self._runs.append_event(run.training_run_id, "recovered", {"stage": run.stage})
        if run.stage in (RunStage.QUEUED, RunStage.TRAINING):
            log.warning("training run %s was interrupted by a restart; its samples go back to pending",
                        run.training_run_id, extra={"training_run_id": run.training_run_id})
            run = await self._runs.finish(
                run.training_run_id, RunStatus.FAILED, failure_reason="service_restarted", restore_samples=True
            )
            await self._executions.cleanup(run.training_run_id)
            return run
        log.info("training run %s was activating at restart; retrying the activation", run.training_run_id,
                 extra={"training_run_id": run.training_run_id})
        return await self._activation.activate(run)

    async def shutdown(self) -> None:
        """Stop the active run of this process as `POST .../stop` would."""
        await self._executions.cancel_claim_checks()
        for run_id in self._executions.run_ids():
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
        await self._executions.cancel_all()

    def check_health(self) -> None:
        self._executions.check_health()  # a failed execution is sticky until restart
        self._backend.check_health()
