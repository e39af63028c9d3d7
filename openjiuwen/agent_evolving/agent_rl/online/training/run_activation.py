"""A trained run's version goes live (CONTRACT §4.7 `activating`, D3): the gateway's CAS switch to it (`immediate`),
or its start as the candidate of a canary / manual rollout; then the run's end. Also the truth of a stop that lands
while the switch is in flight (D4): the gateway is asked what it serves, and the run ends accordingly.

Every write of the run's record is durable through a Redis outage (durable_writes.py); a write refused by the fence
(`LeaseLost`) propagates: the next leader's recovery activates the same artifact again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import Conflict
from .. import faults
from ..lora.gateway_client import GatewayError, GatewayLoraClient
from ..lora.repository import LoraRepository
from .durable_writes import REDIS_DOWN, DurableWrites
from .freshness import ACTIVATION, Freshness
from .run_records import RunStatus, TrainingRun
from .run_transitions import RunTransitions

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics
    from ..rollout.controller import RolloutController

log = logging.getLogger("openjiuwen.agent_rl.online.training")


class RunActivation:
    def __init__(
        self,
        runs: RunTransitions,
        repository: LoraRepository,
        gateway: GatewayLoraClient,
        durable: DurableWrites,
        *,
        model_id: str,
        base_model_path: str,
        metrics: "ServiceMetrics | None" = None,
        rollout: "RolloutController | None" = None,
        freshness: Freshness | None = None,
    ) -> None:
        self._runs = runs
        self._repository = repository
        self._gateway = gateway
        self._durable = durable
        self._model_id = model_id
        self._base_model_path = base_model_path
        self._metrics = metrics
        self._rollout = rollout  # canary / manual: a new version becomes the candidate, not the active one
        self._freshness = freshness

    async def activate(self, run: TrainingRun) -> TrainingRun:
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
        return await asyncio.shield(self.succeed(run))

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

    def _activation_done(self, outcome: str, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.stage("activating", outcome, seconds)
            self._metrics.activation(outcome, seconds)

    async def succeed(self, run: TrainingRun) -> TrainingRun:
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
        except REDIS_DOWN as exc:
            log.warning("run %s: freshness not measured (%s)", run.training_run_id, exc)
            return None

    async def stop(self, run: TrainingRun) -> TrainingRun:
        """Settle a run stopped while `activating`, once its execution is over: the gateway says whether the switch
        happened (succeeded) or not (canceled)."""
        run_id = run.training_run_id
        if self._rollout is not None and self._rollout.gated:
            return await self._stop_canary_start(run)
        try:
            policy = await self._gateway.read_policy_retrying(line=run.line(self._model_id))
        except GatewayError as exc:
            return await self._runs.finish(
                run_id, RunStatus.CANCELED, failure_reason=f"activation outcome unknown: {exc}"
            )
        if policy.lora_name == run.lora_name:
            return await self.succeed(run)
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
