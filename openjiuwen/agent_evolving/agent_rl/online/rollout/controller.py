"""The rollout controller: a succeeded run's version becomes the gateway's candidate, a decision loop compares the
arms and promotes or rolls back, and the operator may promote, roll back, pause, resume or activate any published
version (docs/rollout.md).

Every change is an intent written to Redis first (`promoting`, `rolling_back`, `activating`), then the gateway call
(idempotent, CAS on the names), then the end state (changes.py): a restart at any point finishes what was started,
and the gateway's own state file keeps the candidate across a gateway restart. The decision loop is
decision_loop.py, a canary's evaluation evaluation.py; this class is the rollout's face to the rest of the service:
start-up, a run's new version, the operator's decisions, the follower's view.

Per line (docs/lineages.md "Rollout per lineage"): every lineage's line has its own rollout (record, pointer, arms,
decision and lock); lines never wait for each other. The default line's records, keys and routes are exactly what
they were before lineages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis

from ..errors import Conflict, InvalidInput, NotFound
from ..events import EventLog
from ...common.ids import now_iso
from ...common.lineage import DEFAULT_LINEAGE, InvalidLineage, line_of, parse_version_name, split_line
from ..lora.gateway_client import GatewayError, GatewayLoraClient, GatewayRejected
from ..lora.repository import LoraRepository
from ..store import keys
from .changes import RolloutChanges
from .config import RolloutConfig
from .decision import PROMOTE, ROLLBACK
from .evaluation import CanaryEvaluation
from .record import ACTIVATION_KIND, CANARY_KIND, LoraRef, Rollout
from .status import RolloutStatus
from .store import RolloutStore, new_rollout_id, rollout_id_for_run

if TYPE_CHECKING:
    from ..tasks.task_records import Task
    from ..training.run_records import TrainingRun

log = logging.getLogger("openjiuwen.agent_rl.online.rollout")

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
        changes: RolloutChanges,
        evaluation: CanaryEvaluation,
        *,
        config: RolloutConfig,
        model_id: str,
        base_model_path: str,
        active_run: Callable[[str], Awaitable[Any]],  # (lineage) → its live Training Run or None
    ) -> None:
        self._redis = redis
        self.store = store
        self._gateway = gateway
        self._repository = repository
        self._changes = changes  # every change of rollout state, under the line's lock; each line's live rollout
        self._evaluation = evaluation
        self.config = config
        self._model_id = model_id
        self._base_model_path = base_model_path
        self._active_run = active_run
        self._events = EventLog(redis)

    @property
    def gated(self) -> bool:
        return self.config.gated

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
            other = self._changes.remember(await self.store.current(lineage), lineage)
            if other is not None and other.in_flight:
                log.info("rollout %s (lineage %s) was %s at restart; finishing it", other.rollout_id, lineage,
                         other.status)
                await self._changes.finish(other)
        record = self._changes.remember(await self.store.current())
        if record is not None and record.in_flight:
            log.info("rollout %s was %s at restart; finishing it", record.rollout_id, record.status)
            record = await self._changes.finish(record)
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

    # ------------------------------------------------------------------ a run's new version

    async def begin(self, run: "TrainingRun") -> Rollout:
        """Make a succeeded run's version the candidate (gateway first, then the record). Idempotent per run.
        Raises GatewayError when the gateway refuses or fails, Conflict when another rollout is in progress."""
        assert run.lora_name and run.lora_path
        lineage = run.lineage
        rollout_id = rollout_id_for_run(run.training_run_id)
        existing = await self.store.get(rollout_id)
        if existing is not None:
            return self._changes.remember(existing, lineage) or existing
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
        stored = await self._changes.create(record, "canary_started", {
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
        return self._changes.remember(await self.store.current(lineage), lineage)

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
            self._changes.remember(await self.store.current(lineage), lineage)
        self._changes.forget_all_but([DEFAULT_LINEAGE, *live])

    async def task_started(self, task: "Task") -> None:
        """Mark a new Task's arm in its timeline while its line's canary runs (best-effort, like every note
        event)."""
        live = self._changes.live(task.lineage)
        if live is None or not live.canary or not live.deciding:
            return
        arms = {live.candidate.lora_name: "candidate", live.baseline.lora_name: "active"}
        arm = arms.get(task.policy_lora_name)
        if arm is not None:
            await self._events.append(keys.task_events(task.rl_task_id), "rollout_arm", {
                "rollout_id": live.rollout_id, "arm": arm, "lora_name": task.policy_lora_name})

    # ------------------------------------------------------------------ operator

    async def status(self, lineage: str = DEFAULT_LINEAGE) -> dict[str, Any]:
        """The line's current rollout with its live evaluation (arms, interval, the decision it would take), and
        the latest ended ones of that line."""
        record = await self.store.current(lineage)
        current = None
        if record is not None:
            current = record.public()
            if record.canary:
                current["evaluation"] = (await self._evaluation.evaluate(record)).public()
        # The listing is across lines (newest first); a line's latest ten are among the newest few hundred
        # unless other lines roll out far more often, which then shows fewer of this line's, never another's.
        recent = []
        for r in [r for r in await self.store.list_recent(200) if r.lineage == lineage and
                  (record is None or r.rollout_id != record.rollout_id)][:10]:
            shown = r.public()
            if r.canary and r.decision is None:
                shown["evaluation"] = (await self._evaluation.evaluate(r)).public()
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
        async with self._changes.lock(lineage):
            record = await self._require_canary(lineage)
            if not record.deciding:
                raise Conflict(f"the canary is already {record.status}", code="no_rollout")
            decision = (await self._evaluation.evaluate(record)).public()
            return await self._changes.act(record, action, {**decision, "action": action, "reason": "operator",
                                                            "detail": detail}, by="operator")

    async def pause(self, paused: bool = True, lineage: str = DEFAULT_LINEAGE) -> Rollout:
        """Stop (or resume) automatic decisions of a line; the split of new Tasks goes on meanwhile."""
        async with self._changes.lock(lineage):
            record = await self._require_canary(lineage)
            want, have = ((RolloutStatus.PAUSED, RolloutStatus.RUNNING) if paused
                          else (RolloutStatus.RUNNING, RolloutStatus.PAUSED))

            def change(r: Rollout) -> Rollout | None:
                return r.evolve(status=want) if r.status == have else None

            return await self._changes.update(record.rollout_id, change, "paused" if paused else "resumed", {})

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
        async with self._changes.lock(lineage):
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
            record = await self._changes.create(record, "activation_requested",
                                                {"lora_name": lora_name, "previous": policy.lora_name})
            return await self._changes.finish(record)
