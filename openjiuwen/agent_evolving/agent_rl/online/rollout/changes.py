"""Every change of a line's rollout state in this process (docs/rollout.md): a decision becomes an intent written to
Redis first (`promoting`, `rolling_back`, `activating`), then the gateway call (idempotent, CAS on the names), then
the end state, so a restart at any point finishes what was started (`finish`).

Per line (docs/lineages.md "Rollout per lineage"): one change at a time per line (its lock), lines never wait for
each other. This class also keeps each line's live rollout as this process last wrote or read it (`remember`), so
that a Task start costs no Redis read to know its arm.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from .. import faults
from ...common.ids import now_iso
from ...common.lineage import DEFAULT_LINEAGE, line_of
from ..lora.gateway_client import GatewayError, GatewayLoraClient, GatewayRejected, GatewayTransient
from ..lora.repository import LoraRepository
from .decision import PROMOTE
from .record import LoraRef, Rollout
from .status import RolloutStatus
from .store import RolloutStore

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics

log = logging.getLogger("openjiuwen.agent_rl.online.rollout")


class RolloutChanges:
    def __init__(
        self,
        store: RolloutStore,
        gateway: GatewayLoraClient,
        repository: LoraRepository,
        *,
        model_id: str,
        base_model_path: str,
        observe_policy: Callable[..., Awaitable[None]],  # (lora_name, lora_path, *, line)
        metrics: "ServiceMetrics | None" = None,
        on_promoted: Callable[[str, float], Awaitable[None]] | None = None,  # (run id, epoch): freshness
    ) -> None:
        self._store = store
        self._gateway = gateway
        self._repository = repository
        self._model_id = model_id
        self._base_model_path = base_model_path
        self._observe_policy = observe_policy
        self._metrics = metrics
        self._on_promoted = on_promoted
        # One change of rollout state at a time per line in this process; lines never wait for each other.
        self._locks: dict[str, asyncio.Lock] = {}
        # Each line's live canary as this process last wrote or read it (every change of rollout state happens
        # here), so that a Task start costs no Redis read to know its arm. Keyed by lineage.
        self._live: dict[str, Rollout] = {}

    def lock(self, lineage: str) -> asyncio.Lock:
        lock = self._locks.get(lineage)
        if lock is None:
            lock = self._locks[lineage] = asyncio.Lock()
        return lock

    # ------------------------------------------------------------------ each line's live rollout

    def remember(self, record: Rollout | None, lineage: str | None = None) -> Rollout | None:
        lineage = record.lineage if record is not None else (lineage or DEFAULT_LINEAGE)
        if record is None:
            self._live.pop(lineage, None)
        elif record.live:
            self._live[lineage] = record
        elif (live := self._live.get(lineage)) is not None and live.rollout_id == record.rollout_id:
            self._live.pop(lineage, None)
        return record

    def live(self, lineage: str) -> Rollout | None:
        return self._live.get(lineage)

    def forget_all_but(self, lineages: Iterable[str]) -> None:
        for gone in set(self._live) - set(lineages):
            self._live.pop(gone, None)

    # ------------------------------------------------------------------ changes

    async def act(self, record: Rollout, action: str, decision: dict[str, Any], *, by: str) -> Rollout:
        target = RolloutStatus.PROMOTING if action == PROMOTE else RolloutStatus.ROLLING_BACK
        note = {**decision, "by": by, "at": now_iso()}
        note.pop("arms", None)
        arms = decision.get("arms")

        def change(r: Rollout) -> Rollout | None:
            if not r.deciding:
                return None
            return r.evolve(status=target, decision={**note, "arms": arms})

        event = "promotion_started" if action == PROMOTE else "rollback_started"
        record = await self.update(record.rollout_id, change, event,
                                   {"reason": note.get("reason"), "detail": note.get("detail"), "by": by})
        if self._metrics is not None:
            self._metrics.rollout_decision(action, str(note.get("reason")), by)
        log.info("rollout %s: %s (%s, by %s)", record.rollout_id, action, note.get("detail"), by)
        faults.reached("rollout.intent")
        return await self.finish(record)

    async def finish(self, record: Rollout) -> Rollout:
        """Make the gateway match the intent, then end the record. A transient gateway failure leaves the intent
        for the next round; a refusal ends it with what the gateway now holds."""
        rollout_id, status = record.rollout_id, record.status
        candidate, baseline = record.candidate, record.baseline
        try:
            if status == RolloutStatus.PROMOTING:
                await self._gateway.promote_canary(base_model=self._base_model_path, lora_name=candidate.lora_name,
                                                   expected=baseline.lora_name)
                await self.now_active(record.lineage, candidate, record.training_run_id or "")
                faults.reached("rollout.switched")
                promoted = await self.update(rollout_id, lambda r: r.evolve(status=RolloutStatus.PROMOTED),
                                             "canary_promoted", {"lora_name": candidate.lora_name})
                await self._measure_promotion(promoted)
                return promoted
            if status == RolloutStatus.ROLLING_BACK:
                await self._gateway.abort_canary(base_model=self._base_model_path, lora_name=candidate.lora_name)
                faults.reached("rollout.switched")
                return await self.update(rollout_id, lambda r: r.evolve(status=RolloutStatus.ROLLED_BACK),
                                         "canary_rolled_back", {"lora_name": candidate.lora_name,
                                                                "active": baseline.lora_name})
            if status == RolloutStatus.ACTIVATING:
                await self._gateway.activate(base_model=self._base_model_path, lora_name=candidate.lora_name,
                                             lora_path=candidate.lora_path, expected=baseline.lora_name,
                                             run_id="")
                await self.now_active(record.lineage, candidate, "")
                return await self.update(rollout_id, lambda r: r.evolve(status=RolloutStatus.ACTIVATED),
                                         "version_activated", {"lora_name": candidate.lora_name,
                                                               "previous": baseline.lora_name})
        except GatewayTransient:
            raise
        except GatewayError as exc:
            if status == RolloutStatus.PROMOTING and isinstance(exc, GatewayRejected):
                # The gateway no longer has this candidate against this baseline: never leave a half state.
                log.warning("rollout %s: promotion refused (%s); rolling back", rollout_id, exc)
                with_reason = record.evolve(status=RolloutStatus.ROLLING_BACK)
                await self.update(rollout_id, lambda r: with_reason, "rollback_started",
                                  {"reason": "promotion_refused", "detail": str(exc)[:500], "by": "auto"})
                return await self.finish(with_reason)
            if status == RolloutStatus.ACTIVATING or isinstance(exc, GatewayRejected):
                return await self.update(rollout_id, lambda r: r.evolve(status=RolloutStatus.FAILED, error=str(exc)),
                                         "failed", {"error": str(exc)[:500]})
            raise
        return record

    async def _measure_promotion(self, record: Rollout) -> None:
        """The candidate is its line's policy now: its run's sample-to-policy latency (training/freshness.py). A
        measurement: a Redis failure loses it, never the promotion."""
        if self._on_promoted is None or not record.training_run_id:
            return
        try:
            await self._on_promoted(record.training_run_id, time.time())
        except RedisError as exc:
            log.warning("rollout %s: freshness of run %s not recorded (%s)", record.rollout_id,
                        record.training_run_id, exc)

    async def create(self, record: Rollout, event: str, data: dict[str, Any]) -> Rollout:
        return self.remember(await self._store.create(record, event, data)) or record

    async def update(self, rollout_id: str, change: Any, event: str | None = None,
                     data: dict[str, Any] | None = None) -> Rollout:
        record = await self._store.update(rollout_id, change, event, data)
        self.remember(record)
        return record

    async def now_active(self, lineage: str, lora: LoraRef, run_id: str) -> None:
        # The fenced write first, on every line (`policy:observed` for the default line, the AIGW key; the line's
        # field of `policy:observed_lines` for another): a deposed leader stops here rather than write the
        # repository's marker (a file carries no token; the next leader, finishing the same intent, writes the same).
        line = line_of(self._model_id, lineage)
        await self._observe_policy(lora.lora_name, lora.lora_path, line=line)
        await self._repository.for_line(line).write_active(lora.lora_name, lora.lora_path, run_id)
