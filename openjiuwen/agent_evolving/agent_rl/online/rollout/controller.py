"""The rollout controller: a succeeded run's version becomes the gateway's candidate, a decision loop compares the
arms and promotes or rolls back, and the operator may promote, roll back, pause, resume or activate any published
version (docs/rollout.md).

Every change is an intent written to Redis first (`promoting`, `rolling_back`, `activating`), then the gateway call
(idempotent, CAS on the names), then the end state: a restart at any point finishes what was started, and the
gateway's own state file keeps the candidate across a gateway restart.

Per line (docs/lineages.md "Rollout per lineage"): every lineage's line has its own rollout (record, pointer, arms,
decision and lock); lines never wait for each other. The default line's records, keys and routes are exactly what
they were before lineages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from ..background import stop_loop
from ..errors import Conflict, InvalidInput, NotFound
from ..events import EventLog
from .. import faults
from ...common.ids import now_iso, parse_iso_epoch
from ...common.lineage import DEFAULT_LINEAGE, InvalidLineage, line_of, parse_version_name, split_line
from ..lora.gateway_client import GatewayError, GatewayLoraClient, GatewayRejected, GatewayTransient
from ..lora.repository import LoraRepository
from ..store import keys
from ..store.codec import text
from ..store.fence import LeaseLost
from .config import CANARY, RolloutConfig
from .decision import PROMOTE, ROLLBACK, WAIT, Arm, Decision, decide
from .record import ACTIVATION_KIND, CANARY_KIND, LoraRef, Rollout
from .status import RolloutStatus
from .store import RolloutStore, new_rollout_id, rollout_id_for_run

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics
    from ..tasks.task_records import Task
    from ..training.run_records import TrainingRun

log = logging.getLogger("openjiuwen.agent_rl.online.rollout")

_SCAN_BATCH = 500
PROBE_ATTEMPTS = 5


class RolloutUnsupported(RuntimeError):
    """`rollout.mode` needs the gateway's canary routes and the gateway lacks them (start-up refuses)."""


class RolloutController:
    def __init__(
        self,
        redis: Redis,
        store: RolloutStore,
        gateway: GatewayLoraClient,
        repository: LoraRepository,
        *,
        config: RolloutConfig,
        model_id: str,
        base_model_path: str,
        observe_policy: Callable[..., Awaitable[None]],  # (lora_name, lora_path, *, line)
        active_run: Callable[[str], Awaitable[Any]],  # (lineage) → its live Training Run or None
        metrics: "ServiceMetrics | None" = None,
        on_promoted: Callable[[str, float], Awaitable[None]] | None = None,  # (run id, epoch): freshness
    ) -> None:
        self._redis = redis
        self.store = store
        self._gateway = gateway
        self._repository = repository
        self.config = config
        self._model_id = model_id
        self._base_model_path = base_model_path
        self._observe_policy = observe_policy
        self._active_run = active_run
        self._metrics = metrics
        self._on_promoted = on_promoted
        # One change of rollout state at a time per line in this process; lines never wait for each other.
        self._locks: dict[str, asyncio.Lock] = {}
        self._loop: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        # Each line's live canary as this process last wrote or read it (every change of rollout state happens
        # here), so that a Task start costs no Redis read to know its arm. Keyed by lineage.
        self._live: dict[str, Rollout] = {}
        self._events = EventLog(redis)

    @property
    def gated(self) -> bool:
        return self.config.gated

    def _lock(self, lineage: str) -> asyncio.Lock:
        lock = self._locks.get(lineage)
        if lock is None:
            lock = self._locks[lineage] = asyncio.Lock()
        return lock

    def _line(self, lineage: str) -> str:
        return line_of(self._model_id, lineage)

    def lineage_of_line(self, line: str | None) -> str:
        """The lineage of a line of this model (None: the default line); InvalidInput for anything else."""
        if line is None:
            return DEFAULT_LINEAGE
        try:
            model_id, lineage = split_line(line)
        except InvalidLineage as exc:
            raise InvalidInput("invalid_lineage", str(exc)) from exc
        if model_id != self._model_id:
            raise InvalidInput("invalid_lineage", f"{line!r} is not a line of {self._model_id}")
        return lineage

    async def _lines(self) -> list[str]:
        """The lineages a decision round visits: the default line always, the others only while live."""
        return [DEFAULT_LINEAGE, *await self.store.live_lineages()]

    # ------------------------------------------------------------------ start-up

    async def probe(self) -> None:
        """Under `canary` / `manual`, the gateway must serve the canary routes: refuse to start otherwise (never a
        silent `immediate`). A gateway that does not answer yet is asked again a few times."""
        if not self.gated:
            return
        for attempt in range(PROBE_ATTEMPTS):
            try:
                await self._gateway.canary_status()
                return
            except GatewayRejected as exc:
                raise RolloutUnsupported(
                    f"rollout.mode is {self.config.mode} but the gateway cannot run a canary: {exc}") from exc
            except GatewayError as exc:
                if attempt == PROBE_ATTEMPTS - 1:
                    raise RolloutUnsupported(
                        f"rollout.mode is {self.config.mode} and the gateway's canary routes did not answer: {exc}"
                    ) from exc
                await asyncio.sleep(0.5 * (attempt + 1))

    async def recover(self) -> None:
        """Finish an intent a crash interrupted (promotion, rollback, activation); drop a gateway candidate that no
        live rollout owns (its record was lost with the Redis data, say): left alone it would refuse every later
        canary and activation (409 `canary_conflict`) with nobody to decide it."""
        for lineage in (await self.store.live_lineages())[::-1]:  # other lines first; the default line last
            other = self._remember(await self.store.current(lineage), lineage)
            if other is not None and other.in_flight:
                log.info("rollout %s (lineage %s) was %s at restart; finishing it", other.rollout_id, lineage,
                         other.status)
                await self._finish(other)
        record = self._remember(await self.store.current())
        if record is not None and record.in_flight:
            log.info("rollout %s was %s at restart; finishing it", record.rollout_id, record.status)
            record = await self._finish(record)
        if not self.gated:
            return
        try:
            candidate = (await self._gateway.canary_status()).get("candidate")
            name = candidate.get("lora_name") if isinstance(candidate, dict) else None
            owned = record is not None and record.live and record.candidate.lora_name == name
            if isinstance(name, str) and not owned:
                log.warning("the gateway's candidate %s belongs to no live rollout; aborting it", name)
                await self._gateway.abort_canary(base_model=self._base_model_path, lora_name=name)
        except GatewayError as exc:  # best-effort: the next start tries again, and a new canary says 409 meanwhile
            log.warning("could not check the gateway's candidate at start-up: %s", exc)

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
        # The first round waits an interval too: start-up recovery (`recover`) has just run.
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.decision_interval_seconds)
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

    # ------------------------------------------------------------------ a run's new version

    async def begin(self, run: "TrainingRun") -> Rollout:
        """Make a succeeded run's version the candidate (gateway first, then the record). Idempotent per run.
        Raises GatewayError when the gateway refuses or fails, Conflict when another rollout is in progress."""
        assert run.lora_name and run.lora_path
        lineage = run.lineage
        rollout_id = rollout_id_for_run(run.training_run_id)
        existing = await self.store.get(rollout_id)
        if existing is not None:
            return self._remember(existing, lineage) or existing
        current = await self.store.current(lineage)
        if current is not None:
            raise Conflict(f"rollout {current.rollout_id} is in progress", code="rollout_in_progress")
        try:
            answer = await self._start_canary(run)
        except GatewayRejected as exc:
            # Start-up drops an orphan candidate of the default line only (asking every registered lineage's
            # line would cost one call each); another line's orphan (its record lost with the Redis data) is
            # dropped here, when its line's next canary meets it, and the start is tried once more.
            if lineage == DEFAULT_LINEAGE or "canary_conflict" not in str(exc) \
                    or not await self._drop_orphan(lineage, keep=run.lora_name):
                raise
            answer = await self._start_canary(run)
        started_at = (answer.get("candidate") or {}).get("started_at") or now_iso()
        record = Rollout(
            rollout_id=rollout_id, kind=CANARY_KIND, mode=self.config.mode, status=RolloutStatus.RUNNING,
            candidate=LoraRef(run.lora_name, run.lora_path),
            baseline=LoraRef(run.parent_lora_name, run.parent_lora_path),
            share=self.config.share, training_run_id=run.training_run_id, created_at=now_iso(),
            window_started_at=started_at, lineage=lineage,
        )
        stored = await self._create(record, "canary_started", {
            "lora_name": run.lora_name, "baseline": run.parent_lora_name, "share": self.config.share,
            "mode": self.config.mode})
        log.info("canary %s: %s for %.0f%% of new Tasks against %s", rollout_id, run.lora_name,
                 self.config.share * 100, run.parent_lora_name)
        return stored

    async def _start_canary(self, run: "TrainingRun") -> dict[str, Any]:
        assert run.lora_name and run.lora_path
        return await self._gateway.start_canary(
            base_model=self._base_model_path, lora_name=run.lora_name, lora_path=run.lora_path,
            expected=run.parent_lora_name, share=self.config.share,
        )

    async def _drop_orphan(self, lineage: str, *, keep: str) -> bool:
        """Abort the gateway candidate of a line that has no live rollout (the caller checked); True if one was."""
        candidate = (await self._gateway.canary_status(self._line(lineage))).get("candidate")
        name = candidate.get("lora_name") if isinstance(candidate, dict) else None
        if not isinstance(name, str) or name == keep:
            return False
        log.warning("the gateway's candidate %s belongs to no live rollout of lineage %s; aborting it", name, lineage)
        await self._gateway.abort_canary(base_model=self._base_model_path, lora_name=name)
        return True

    async def record_of(self, run: "TrainingRun") -> Rollout | None:
        """The canary a run's version started, if it got its record."""
        return await self.store.get(rollout_id_for_run(run.training_run_id))

    async def in_progress(self, line: str | None = None) -> Rollout | None:
        """The rollout not ended of `line` (`<model_id>` or `<model_id>:<lineage>`; None: the default line)."""
        lineage = self.lineage_of_line(line)
        return self._remember(await self.store.current(lineage), lineage)

    async def live_lines(self) -> set[str]:
        """The lines whose rollout is not ended: the default line's pointer and the live-lineage set, two reads
        however many lineages exist (the automatic training holds a line while its rollout decides)."""
        lines = {line_of(self._model_id, lineage) for lineage in await self.store.live_lineages()}
        if await self._redis.exists(keys.rollout_current(DEFAULT_LINEAGE)):
            lines.add(self._model_id)
        return lines

    async def refresh(self) -> None:
        """A follower's beat: every line's live rollout as Redis has it, so that a Task start here marks its arm."""
        live = await self.store.live_lineages()
        for lineage in [DEFAULT_LINEAGE, *live]:
            self._remember(await self.store.current(lineage), lineage)
        for gone in set(self._live) - {DEFAULT_LINEAGE, *live}:
            self._live.pop(gone, None)

    def _remember(self, record: Rollout | None, lineage: str | None = None) -> Rollout | None:
        lineage = record.lineage if record is not None else (lineage or DEFAULT_LINEAGE)
        if record is None:
            self._live.pop(lineage, None)
        elif record.live:
            self._live[lineage] = record
        elif (live := self._live.get(lineage)) is not None and live.rollout_id == record.rollout_id:
            self._live.pop(lineage, None)
        return record

    async def task_started(self, task: "Task") -> None:
        """Mark a new Task's arm in its timeline while its line's canary runs (best-effort, like every note
        event)."""
        live = self._live.get(task.lineage)
        if live is None or not live.canary or not live.deciding:
            return
        arms = {live.candidate.lora_name: "candidate", live.baseline.lora_name: "active"}
        arm = arms.get(task.policy_lora_name)
        if arm is not None:
            await self._events.append(keys.task_events(task.rl_task_id), "rollout_arm", {
                "rollout_id": live.rollout_id, "arm": arm, "lora_name": task.policy_lora_name})

    # ------------------------------------------------------------------ decisions

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
        async with self._lock(lineage):
            record = self._remember(await self.store.current(lineage), lineage)
            if record is None:
                if lineage == DEFAULT_LINEAGE:
                    self._report(None, None)
                return None
            if record.in_flight:
                await self._finish(record)
                return None
            if not record.canary:
                return None
            decision = await self.evaluate(record)
            self._report(record, decision, lineage)  # series per live canary's lineage (bounded: metrics.py)
            if record.mode == CANARY and record.status == RolloutStatus.RUNNING and decision.action != WAIT:
                await self._act(record, decision.action, decision.public(), by="auto")
            return decision

    async def evaluate(self, record: Rollout) -> Decision:
        candidate, active = await self.arms(record)
        elapsed = parse_iso_epoch(now_iso()) - parse_iso_epoch(record.window_started_at)
        return decide(candidate, active, self.config, elapsed)

    async def arms(self, record: Rollout) -> tuple[Arm, Arm]:
        """The Tasks created in the canary window, by the version they were pinned to. Read from the Task records
        and their reward states (durable): a restart loses nothing, and older history never counts. Only the line's
        own Tasks are read, from its lineage's creation index (`rl:v1:tasks:by_lineage:{L}`, written in the Task
        start's EXEC), so a decision round costs O(the line's Tasks in the window), never every lineage's."""
        candidate = Arm(record.candidate.lora_name)
        active = Arm(record.baseline.lora_name)
        by_name = {candidate.lora_name: candidate, active.lora_name: active}
        # Only the line's own Tasks count: `base` is every line's baseline before its first version.
        lineage = record.lineage
        start = parse_iso_epoch(record.window_started_at)
        end = parse_iso_epoch(record.ended_at) if record.ended_at else "+inf"
        ids = [text(t) for t in await self._redis.zrangebyscore(keys.tasks_by_lineage(lineage), start, end)]
        for offset in range(0, len(ids), _SCAN_BATCH):
            chunk = ids[offset:offset + _SCAN_BATCH]
            raws = await self._redis.mget([keys.task(t) for t in chunk])
            finalized: list[tuple[str, Arm]] = []
            for t, raw in zip(chunk, raws):
                task = orjson.loads(raw) if raw is not None else None
                arm = by_name.get(task.get("policy_lora_name")) if isinstance(task, dict) else None
                if arm is None or (task.get("lineage") or DEFAULT_LINEAGE) != lineage:  # the index says so; kept
                    continue
                arm.tasks += 1
                if task.get("evaluation") is True:  # evaluation Tasks count too, and are shown apart
                    arm.evaluation += 1
                if task.get("status") == "aborted":
                    arm.ended += 1
                    arm.failed += 1
                elif task.get("status") == "finalized":
                    arm.ended += 1
                    finalized.append((t, arm))
            if finalized:
                rewards = await self._redis.mget([keys.reward(t) for t, _ in finalized])
                for (_, arm), raw in zip(finalized, rewards):
                    state = orjson.loads(raw) if raw is not None else None
                    if isinstance(state, dict) and state.get("status") == "published":
                        arm.add_reward(float(state["reward"]))
        return candidate, active

    def _report(self, record: Rollout | None, decision: Decision | None,
                lineage: str = DEFAULT_LINEAGE) -> None:
        if self._metrics is not None:
            self._metrics.rollout_state(record.status if record is not None else None, decision, lineage)

    async def _act(self, record: Rollout, action: str, decision: dict[str, Any], *, by: str) -> Rollout:
        target = RolloutStatus.PROMOTING if action == PROMOTE else RolloutStatus.ROLLING_BACK
        note = {**decision, "by": by, "at": now_iso()}
        note.pop("arms", None)
        arms = decision.get("arms")

        def change(r: Rollout) -> Rollout | None:
            if not r.deciding:
                return None
            return r.evolve(status=target, decision={**note, "arms": arms})

        event = "promotion_started" if action == PROMOTE else "rollback_started"
        record = await self._update(record.rollout_id, change, event,
                                         {"reason": note.get("reason"), "detail": note.get("detail"), "by": by})
        if self._metrics is not None:
            self._metrics.rollout_decision(action, str(note.get("reason")), by)
        log.info("rollout %s: %s (%s, by %s)", record.rollout_id, action, note.get("detail"), by)
        faults.reached("rollout.intent")
        return await self._finish(record)

    async def _finish(self, record: Rollout) -> Rollout:
        """Make the gateway match the intent, then end the record. A transient gateway failure leaves the intent
        for the next round; a refusal ends it with what the gateway now holds."""
        rollout_id, status = record.rollout_id, record.status
        candidate, baseline = record.candidate, record.baseline
        try:
            if status == RolloutStatus.PROMOTING:
                await self._gateway.promote_canary(base_model=self._base_model_path, lora_name=candidate.lora_name,
                                                   expected=baseline.lora_name)
                await self._now_active(record.lineage, candidate, record.training_run_id or "")
                faults.reached("rollout.switched")
                promoted = await self._update(rollout_id, lambda r: r.evolve(status=RolloutStatus.PROMOTED),
                                              "canary_promoted", {"lora_name": candidate.lora_name})
                await self._measure_promotion(promoted)
                return promoted
            if status == RolloutStatus.ROLLING_BACK:
                await self._gateway.abort_canary(base_model=self._base_model_path, lora_name=candidate.lora_name)
                faults.reached("rollout.switched")
                return await self._update(rollout_id, lambda r: r.evolve(status=RolloutStatus.ROLLED_BACK),
                                          "canary_rolled_back", {"lora_name": candidate.lora_name,
                                                                 "active": baseline.lora_name})
            if status == RolloutStatus.ACTIVATING:
                await self._gateway.activate(base_model=self._base_model_path, lora_name=candidate.lora_name,
                                             lora_path=candidate.lora_path, expected=baseline.lora_name,
                                             run_id="")
                await self._now_active(record.lineage, candidate, "")
                return await self._update(rollout_id, lambda r: r.evolve(status=RolloutStatus.ACTIVATED),
                                          "version_activated", {"lora_name": candidate.lora_name,
                                                                "previous": baseline.lora_name})
        except GatewayTransient:
            raise
        except GatewayError as exc:
            if status == RolloutStatus.PROMOTING and isinstance(exc, GatewayRejected):
                # The gateway no longer has this candidate against this baseline: never leave a half state.
                log.warning("rollout %s: promotion refused (%s); rolling back", rollout_id, exc)
                with_reason = record.evolve(status=RolloutStatus.ROLLING_BACK)
                await self._update(rollout_id, lambda r: with_reason, "rollback_started",
                                   {"reason": "promotion_refused", "detail": str(exc)[:500], "by": "auto"})
                return await self._finish(with_reason)
            if status == RolloutStatus.ACTIVATING or isinstance(exc, GatewayRejected):
                return await self._update(rollout_id, lambda r: r.evolve(status=RolloutStatus.FAILED, error=str(exc)),
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

    async def _create(self, record: Rollout, event: str, data: dict[str, Any]) -> Rollout:
        return self._remember(await self.store.create(record, event, data)) or record

    async def _update(self, rollout_id: str, change: Any, event: str | None = None,
                      data: dict[str, Any] | None = None) -> Rollout:
        record = await self.store.update(rollout_id, change, event, data)
        self._remember(record)
        return record

    async def _now_active(self, lineage: str, lora: LoraRef, run_id: str) -> None:
        # The fenced write first, on every line (`policy:observed` for the default line, the AIGW key; the line's
        # field of `policy:observed_lines` for another): a deposed leader stops here rather than write the
        # repository's marker (a file carries no token; the next leader, finishing the same intent, writes the same).
        line = self._line(lineage)
        await self._observe_policy(lora.lora_name, lora.lora_path, line=line)
        await self._repository.for_line(line).write_active(lora.lora_name, lora.lora_path, run_id)

    # ------------------------------------------------------------------ operator

    async def status(self, lineage: str = DEFAULT_LINEAGE) -> dict[str, Any]:
        """The line's current rollout with its live evaluation (arms, interval, the decision it would take), and
        the latest ended ones of that line."""
        record = await self.store.current(lineage)
        current = None
        if record is not None:
            current = record.public()
            if record.canary:
                current["evaluation"] = (await self.evaluate(record)).public()
        # The listing is across lines (newest first); a line's latest ten are among the newest few hundred
        # unless other lines roll out far more often, which then shows fewer of this line's, never another's.
        recent = []
        for r in [r for r in await self.store.list_recent(200) if r.lineage == lineage and
                  (record is None or r.rollout_id != record.rollout_id)][:10]:
            shown = r.public()
            if r.canary and r.decision is None:
                shown["evaluation"] = (await self.evaluate(r)).public()
            recent.append(shown)
        answer = {"mode": self.config.mode, "config": self.config.model_dump(), "current": current, "recent": recent}
        if lineage != DEFAULT_LINEAGE:  # the default line's answer stays as it was before lineages
            answer["lineage"] = lineage
        return answer

    async def _require_canary(self, lineage: str) -> Rollout:
        record = await self.store.current(lineage)
        if record is None or not record.canary:
            where = "" if lineage == DEFAULT_LINEAGE else f" for lineage {lineage!r}"
            raise Conflict(f"no canary is in progress{where}", code="no_rollout")
        return record

    async def promote(self, lineage: str = DEFAULT_LINEAGE) -> Rollout:
        return await self._operator_decides(lineage, PROMOTE, "promoted by the operator")

    async def rollback(self, lineage: str = DEFAULT_LINEAGE) -> Rollout:
        return await self._operator_decides(lineage, ROLLBACK, "rolled back by the operator")

    async def _operator_decides(self, lineage: str, action: str, detail: str) -> Rollout:
        """The operator's promote or roll back of the line's deciding canary, recorded with the arms' evaluation at
        that moment (409 `no_rollout` when no canary of the line is deciding)."""
        async with self._lock(lineage):
            record = await self._require_canary(lineage)
            if not record.deciding:
                raise Conflict(f"the canary is already {record.status}", code="no_rollout")
            decision = (await self.evaluate(record)).public()
            return await self._act(record, action, {**decision, "action": action, "reason": "operator",
                                                    "detail": detail}, by="operator")

    async def pause(self, paused: bool = True, lineage: str = DEFAULT_LINEAGE) -> Rollout:
        """Stop (or resume) automatic decisions of a line; the split of new Tasks goes on meanwhile."""
        async with self._lock(lineage):
            record = await self._require_canary(lineage)
            want, have = ((RolloutStatus.PAUSED, RolloutStatus.RUNNING) if paused
                          else (RolloutStatus.RUNNING, RolloutStatus.PAUSED))

            def change(r: Rollout) -> Rollout | None:
                return r.evolve(status=want) if r.status == have else None

            return await self._update(record.rollout_id, change, "paused" if paused else "resumed", {})

    async def activate_version(self, lora_name: object) -> Rollout:
        """Activate a published version of a line of this model for every new Task of that line (an operator's
        rollback to an earlier version, or a roll forward), through a rollout record of kind `activation`. The
        line is the version's own (`<line>:vN`)."""
        parsed = parse_version_name(lora_name)
        if parsed is None or split_line(parsed[0])[0] != self._model_id:
            raise InvalidInput("invalid_lora_name", f"lora_name must be `{self._model_id}:v<N>` or "
                                                    f"`{self._model_id}:<lineage>:v<N>`")
        assert isinstance(lora_name, str)
        line, version = parsed
        lineage = split_line(line)[1]
        repository = self._repository.for_line(line)
        complete = await asyncio.to_thread(repository.complete_versions)
        if version not in complete:
            raise NotFound(f"{lora_name} is not a published version")
        path = str(repository.version_path(version))
        async with self._lock(lineage):
            current = await self.store.current(lineage)
            if current is not None:
                raise Conflict(f"rollout {current.rollout_id} is in progress: promote or roll it back first",
                               code="rollout_in_progress")
            if await self._active_run(lineage) is not None:
                raise Conflict("a Training Run of this lineage is in progress: its activation would race this one",
                               code="training_in_progress")
            try:
                policy = await self._gateway.read_policy_retrying(line=None if lineage == DEFAULT_LINEAGE else line)
            except GatewayError as exc:
                raise Conflict(f"cannot read the active policy from the gateway: {exc}",
                               code="gateway_unavailable") from exc
            if policy.lora_name == lora_name:
                raise Conflict(f"{lora_name} is already active", code="lora_already_active")
            record = Rollout(
                rollout_id=new_rollout_id(), kind=ACTIVATION_KIND, mode="operator", status=RolloutStatus.ACTIVATING,
                candidate=LoraRef(lora_name, path), baseline=LoraRef(policy.lora_name, policy.lora_path),
                share=1.0, created_at=now_iso(), window_started_at=now_iso(),
                decision={"action": "activate", "reason": "operator", "by": "operator", "at": now_iso()},
                lineage=lineage,
            )
            record = await self._create(record, "activation_requested",
                                        {"lora_name": lora_name, "previous": policy.lora_name})
            return await self._finish(record)
