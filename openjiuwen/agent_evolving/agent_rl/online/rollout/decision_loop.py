"""The leader's rollout decision loop (docs/rollout.md "Decision"): every `decision_interval_seconds`, each line with
a live rollout (the default line always) finishes an interrupted intent, or evaluates its running canary and, in
`canary` mode and not paused, promotes or rolls it back. Lines never wait for each other."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from ..background import stop_loop
from ...common.lineage import DEFAULT_LINEAGE
from ..store.fence import LeaseLost
from .changes import RolloutChanges
from .config import CANARY, RolloutConfig
from .decision import WAIT, Decision
from .evaluation import CanaryEvaluation
from .record import Rollout
from .status import RolloutStatus
from .store import RolloutStore

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics

log = logging.getLogger("openjiuwen.agent_rl.online.rollout")


class DecisionLoop:
    def __init__(
        self,
        store: RolloutStore,
        changes: RolloutChanges,
        evaluation: CanaryEvaluation,
        *,
        config: RolloutConfig,
        metrics: "ServiceMetrics | None" = None,
    ) -> None:
        self._store = store
        self._changes = changes
        self._evaluation = evaluation
        self._config = config
        self._metrics = metrics
        self._loop: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        if self._loop is None:
            self._stopping = asyncio.Event()
            self._loop = asyncio.create_task(self._run(), name="rollout-decisions")

    async def stop(self) -> None:
        await stop_loop(self._loop, self._stopping)
        self._loop = None

    async def _run(self) -> None:
        # Ended by the stop event, not only the cancellation: redis-py can swallow a cancellation that lands inside
        # a command (background.py).
        # The first round waits an interval too: start-up recovery (`RolloutController.recover`) has just run.
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._config.decision_interval_seconds)
            if self._stopping.is_set():
                return
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except LeaseLost as exc:  # deposed: the next leader's recovery finishes what this round began
                log.warning("rollout decisions stop: %s", exc)
                return
            except Exception as exc:  # the next round tries again; the state is durable
                log.warning("rollout decision round failed: %s", exc, exc_info=True)
                if self._metrics is not None:
                    self._metrics.exception(exc)

    async def _lines(self) -> list[str]:
        """The lineages a decision round visits: the default line always, the others only while live."""
        return [DEFAULT_LINEAGE, *await self._store.live_lineages()]

    async def tick(self) -> dict[str, Decision | None]:
        """One decision round over every line with a live rollout (the default line always): lineage → the
        decision taken (None: nothing to decide). One line's failure does not keep the others from deciding; the
        first is raised once every line had its turn (a lost lease at once)."""
        decisions: dict[str, Decision | None] = {}
        failure: Exception | None = None
        lines = await self._lines()
        if self._metrics is not None:  # the per-lineage rollout series of canaries that ended go
            self._metrics.rollout_lines(set(lines))
        for lineage in lines:
            try:
                decisions[lineage] = await self.tick_line(lineage)
            except (asyncio.CancelledError, LeaseLost):
                raise
            except Exception as exc:  # the next round tries again; the state is durable
                failure = failure or exc
                log.warning("rollout decision of lineage %s failed: %s", lineage, exc)
        if failure is not None:
            raise failure
        return decisions

    async def tick_line(self, lineage: str = DEFAULT_LINEAGE) -> Decision | None:
        """One decision round of a line: finish an interrupted intent, else evaluate the running canary and, in
        `canary` mode and not paused, act on a promote / rollback verdict."""
        async with self._changes.lock(lineage):
            record = self._changes.remember(await self._store.current(lineage), lineage)
            if record is None:
                if lineage == DEFAULT_LINEAGE:
                    self._report(None, None)
                return None
            if record.in_flight:
                await self._changes.finish(record)
                return None
            if not record.canary:
                return None
            decision = await self._evaluation.evaluate(record)
            self._report(record, decision, lineage)  # series per live canary's lineage (bounded: metrics.py)
            if record.mode == CANARY and record.status == RolloutStatus.RUNNING and decision.action != WAIT:
                await self._changes.act(record, decision.action, decision.public(), by="auto")
            return decision

    def _report(self, record: Rollout | None, decision: Decision | None,
                lineage: str = DEFAULT_LINEAGE) -> None:
        if self._metrics is not None:
            self._metrics.rollout_state(record.status if record is not None else None, decision, lineage)
