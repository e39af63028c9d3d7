"""Archiving, restoring and deleting lineages, and the idle sweep (docs/lineages.md "Lifecycle"). Leader only: the
routes are relayed to the leader (common/wire/routes.py), every write goes through its fence, and what a crash
leaves half done is finished by the next leader from the marker `rl:v1:lineages:retiring`.

- **Archive**: no new Task, no Training Run, no rollout (the lineage's state, lineage_state.py); its versions are
  unloaded at the gateway (`POST /internal/v1/rl/loras/retire`); everything it recorded stays, and its line's active
  version is kept in the state so that a **restore** activates it again.
- **Delete**: the same first step, then its Redis keys go in bounded batches and, on request, its repository files
  (lineage_purge.py); it leaves the registry last.
- Both are refused while the lineage has an active Task (409 `lineage_busy`), a Training Run not ended
  (409 `training_run_conflict`) or a rollout not ended (409 `rollout_in_progress`): the marking EXEC WATCHes the
  lineage's active-Task index, run index and rollout pointer, each of which the competing start writes in its own
  EXEC after WATCHing the state this one writes, so exactly one of the two lands. `default` is neither.
- **Idle**: with `lineages.idle_archive_seconds`, a lineage with no Task started for that long is archived by the
  leader, at most `IDLE_PER_TICK` per round (its latest Task start: `rl:v1:lineages:last_task`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ..common.ids import now_iso
from ..common.lineage import DEFAULT_LINEAGE, is_lineage, line_of
from ..common.policy_names import BASE_POLICY
from ..common.wire.task_states import TaskStatus
from .background import stop_loop
from .errors import Conflict, DomainError, InvalidInput, NotFound
from .lineage_purge import LineagePurge
from .lineage_state import LineageState, LineageStatus, not_live, parse_state
from .lora.gateway_client import GatewayError, GatewayLoraClient
from .store import keys
from .store.codec import text
from .training.run_records import TrainingRun
from .store.fence import Fence, LeaseLost

log = logging.getLogger("openjiuwen.agent_rl.online.lineages")

IDLE_PER_TICK = 16  # idle lineages archived per round at most (each costs two gateway calls: a read, the retire)
RETIRING_PER_ROUND = 64  # unloads and deletions finished per round at most (the marker's oldest)
RETRY_DELAY_S = 5.0  # after a round whose gateway call failed, the next one comes sooner than the interval
_IN_USE = ("lineage_busy", "training_run_conflict", "rollout_in_progress")


class LineageGone(NotFound):
    """Neither `default` nor a registered lineage (404 `lineage_not_found`)."""


class LineageGatewayError(DomainError):
    """The gateway could not read, unload or activate the line's versions (502 `gateway_unavailable`)."""


class UnloadPending(LineageGatewayError):
    """Archived, but the gateway has not confirmed the unload yet: the leader's loop retries it."""


class LineageLifecycle:
    def __init__(
        self,
        redis: Redis,
        *,
        gateway: GatewayLoraClient,
        purge: LineagePurge,
        fence: Fence,
        model_id: str,
        base_model_path: str,
        idle_archive_s: int | None,
        interval_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis, self._gateway, self._purge, self._fence = redis, gateway, purge, fence
        self._model_id, self._base_model_path = model_id, base_model_path
        self._idle_archive_s, self._interval_s, self._clock = idle_archive_s, interval_s, clock
        self._locks: dict[str, asyncio.Lock] = {}  # one per lineage: its operator calls and its unload, in turn
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._kick = asyncio.Event()

    # ------------------------------------------------------------------ reads

    async def state(self, lineage: str) -> LineageState | None:
        """None when live (`default` always is)."""
        if lineage == DEFAULT_LINEAGE:
            return None
        return parse_state(await self._redis.get(keys.lineage_state(lineage)))

    async def describe(self, lineage: str) -> dict[str, Any]:
        """The lifecycle fields of `GET /v1/rl/lineages/{lineage}`."""
        state = await self.state(lineage)
        return {"state": LineageStatus.LIVE.value} if state is None else state.public()

    # ------------------------------------------------------------------ operator calls

    async def archive(self, lineage: str, *, by: str = "operator") -> dict[str, Any]:
        """Archive a live lineage (idempotent: an archived one gets its unload retried); the lifecycle fields."""
        line = await self._registered(lineage)
        async with self._lock(lineage):
            state = await self.state(lineage)
            if state is not None and state.status is LineageStatus.DELETING:
                raise not_live(lineage, state)
            if state is None:
                # The version to restore is read by the unload, after this EXEC: nothing switches the line then.
                await self._mark(lineage, LineageState(LineageStatus.ARCHIVED, now_iso(), by))
                log.info("lineage %s archived (by %s)", lineage, by)
            await self._unload(lineage, line)
        return await self.describe(lineage)

    async def restore(self, lineage: str) -> dict[str, Any]:
        """Make an archived lineage live again, its version at archive time active again on its line."""
        line = await self._registered(lineage)
        async with self._lock(lineage):
            state = await self.state(lineage)
            if state is None:
                raise Conflict(f"lineage {lineage!r} is not archived", code="lineage_not_archived")
            if state.status is LineageStatus.DELETING:
                raise not_live(lineage, state)
            target = state.restore
            if target is not None:
                policy = await self._read_policy(line)
                if policy.lora_name != target["lora_name"]:
                    try:
                        # CAS from what the line serves (base once unloaded): nothing else switches an archived line.
                        await self._gateway.activate(base_model=self._base_model_path, lora_name=target["lora_name"],
                                                     lora_path=target["lora_path"], expected=policy.lora_name,
                                                     run_id="")
                    except GatewayError as exc:
                        raise LineageGatewayError(f"could not activate {target['lora_name']} again: {exc}; the "
                                                  "lineage stays archived") from exc
            state_key = keys.lineage_state(lineage)
            now = self._clock()

            async def body(pipe: Pipeline) -> None:
                current = parse_state(await pipe.get(state_key))
                if current is None or current.status is not LineageStatus.ARCHIVED:
                    raise Conflict(f"lineage {lineage!r} changed meanwhile; retry", code="lineage_not_archived")
                pipe.multi()
                # Live again in one step: the state goes, the unload marker with it, the idle clock restarts, and
                # the line is due for the scheduler's judgement again (keys.TRAINING_WAITING: an archived line is
                # judged as paused and dropped from the due index, so its restore must make it due, as a resume does).
                pipe.delete(state_key)
                pipe.zrem(keys.LINEAGES_RETIRING, lineage)
                pipe.zadd(keys.LINEAGES_LAST_TASK, {lineage: now})
                pipe.zadd(keys.TRAINING_WAITING, {line: now}, lt=True)
                await pipe.execute()

            await self._fence.transact(self._redis, body, state_key)
            log.info("lineage %s restored (serving %s)", lineage, (target or {}).get("lora_name", BASE_POLICY))
        return await self.describe(lineage)

    async def delete(self, lineage: str, *, remove_files: bool) -> dict[str, Any]:
        """Mark a lineage for deletion (live or archived; a repeat keeps the first request) and wake the leader's
        loop that empties it; the lifecycle fields (`deleting`)."""
        await self._registered(lineage)
        async with self._lock(lineage):
            state = await self.state(lineage)
            if state is None or state.status is LineageStatus.ARCHIVED:
                await self._mark(lineage, LineageState(LineageStatus.DELETING, now_iso(), "operator",
                                                       remove_files=remove_files),
                                 archived=state is not None)
                log.info("lineage %s marked for deletion (files %s)", lineage, "removed" if remove_files else "kept")
        self._kick.set()
        return await self.describe(lineage)

    async def _registered(self, lineage: str) -> str:
        if lineage == DEFAULT_LINEAGE:
            raise InvalidInput("lineage_protected", "the default lineage always exists: it is never archived or "
                                                    "deleted")
        if not is_lineage(lineage) or await self._redis.zscore(keys.LINEAGES, lineage) is None:
            raise LineageGone(f"lineage {lineage!r} does not exist")
        return line_of(self._model_id, lineage)

    def _lock(self, lineage: str) -> asyncio.Lock:
        lock = self._locks.get(lineage)
        if lock is None:
            if len(self._locks) > 1024:  # drop the idle ones: a lock is only needed while someone holds it
                self._locks = {name: held for name, held in self._locks.items() if held.locked()}
            lock = self._locks[lineage] = asyncio.Lock()
        return lock

    async def _read_policy(self, line: str) -> Any:
        try:
            return await self._gateway.read_policy_retrying(line=line)
        except GatewayError as exc:
            raise LineageGatewayError(f"cannot read {line}'s active version from the gateway: {exc}") from exc

    async def _mark(self, lineage: str, state: LineageState, *, archived: bool = False) -> None:
        """Record the state (from live, or from archived when `archived`) once nothing of the lineage is in flight,
        in one EXEC with its marker and without its idle clock."""
        state_key = keys.lineage_state(lineage)
        active_index = keys.tasks_by_lineage_status(lineage, TaskStatus.ACTIVE)
        runs_index = keys.runs_by_lineage(lineage)
        rollout_key = keys.rollout_current(lineage)
        queued_at = self._clock()

        async def body(pipe: Pipeline) -> None:
            current = parse_state(await pipe.get(state_key))
            if current is not None and (not archived or current.status is not LineageStatus.ARCHIVED):
                raise not_live(lineage, current)
            if current is None and archived:
                raise Conflict(f"lineage {lineage!r} was restored meanwhile; retry", code="lineage_not_archived")
            if active := await pipe.zcard(active_index):
                raise Conflict(f"lineage {lineage!r} has {active} active Task(s): stop them first "
                               f"(rl task list --lineage {lineage} --status active)", code="lineage_busy")
            for raw_id in await pipe.zrevrange(runs_index, 0, 0):  # a lineage's live run is its newest
                raw = await pipe.get(keys.training_run(text(raw_id) or ""))
                if raw is not None and not TrainingRun.from_json(raw).terminal:
                    raise Conflict(f"training run {text(raw_id)} of lineage {lineage!r} is not ended: stop it "
                                   "first", code="training_run_conflict")
            if (pointer := await pipe.get(rollout_key)) is not None:
                raise Conflict(f"rollout {text(pointer)} of lineage {lineage!r} is in progress: promote or roll it "
                               "back first", code="rollout_in_progress")
            pipe.multi()
            # The state that refuses new Tasks, runs and rollouts (all WATCH it), the marker a new leader resumes
            # from, and the idle clock stopped, together.
            pipe.set(state_key, state.to_json())
            pipe.zadd(keys.LINEAGES_RETIRING, {lineage: queued_at})
            pipe.zrem(keys.LINEAGES_LAST_TASK, lineage)
            await pipe.execute()

        await self._fence.transact(self._redis, body, state_key, active_index, runs_index, rollout_key)

    async def _unload(self, lineage: str, line: str) -> None:
        """Retire an archived lineage's line at the gateway, then drop its marker (the lineage's lock is held).

        The line's active version is read first and kept in the state: nothing switches an archived line, so what it
        serves now is what a restore serves again. A line that serves base (never trained, or retired by an earlier
        try whose answer was lost) leaves the state as it is."""
        state_key = keys.lineage_state(lineage)
        try:
            policy = await self._gateway.read_policy_retrying(line=line)
            if policy.lora_name != BASE_POLICY:
                await self._record_restore(lineage, {"lora_name": policy.lora_name, "lora_path": policy.lora_path})
            await self._gateway.retire_line(line)
        except GatewayError as exc:
            self._kick.set()  # the leader's loop tries again
            raise UnloadPending(f"archived; its versions are unloaded once the gateway answers: {exc}") from exc

        async def body(pipe: Pipeline) -> None:
            current = parse_state(await pipe.get(state_key))
            pipe.multi()
            if current is not None and current.status is LineageStatus.ARCHIVED:
                pipe.zrem(keys.LINEAGES_RETIRING, lineage)
            await pipe.execute()

        await self._fence.transact(self._redis, body, state_key)

    async def _record_restore(self, lineage: str, restore: dict[str, str]) -> None:
        """Keep in the archived state the version a restore activates, when it changed."""
        state_key = keys.lineage_state(lineage)

        async def body(pipe: Pipeline) -> None:
            current = parse_state(await pipe.get(state_key))
            if current is None or current.status is not LineageStatus.ARCHIVED or current.restore == restore:
                return
            pipe.multi()
            pipe.set(state_key, replace(current, restore=restore).to_json())
            await pipe.execute()

        await self._fence.transact(self._redis, body, state_key)

    # ------------------------------------------------------------------ the leader's loop

    async def finish_retiring(self) -> int:
        """Finish the archive unloads and deletions the marker lists, oldest first, at most `RETIRING_PER_ROUND`;
        returns how many finished. A gateway that does not answer ends the round: the rest waits for the next."""
        finished = 0
        for raw in await self._redis.zrange(keys.LINEAGES_RETIRING, 0, RETIRING_PER_ROUND - 1):
            lineage = text(raw) or ""
            if not is_lineage(lineage) or lineage == DEFAULT_LINEAGE:
                await self._fence.write(self._redis, lambda pipe, m=raw: pipe.zrem(keys.LINEAGES_RETIRING, m))
                continue
            line = line_of(self._model_id, lineage)
            state = await self.state(lineage)
            try:
                if state is None:  # restored meanwhile
                    await self._fence.write(self._redis, lambda pipe, m=raw: pipe.zrem(keys.LINEAGES_RETIRING, m))
                elif state.status is LineageStatus.ARCHIVED:
                    async with self._lock(lineage):  # an operator call may have finished it meanwhile
                        now = await self.state(lineage)
                        if now is not None and now.status is LineageStatus.ARCHIVED \
                                and await self._redis.zscore(keys.LINEAGES_RETIRING, lineage) is not None:
                            await self._unload(lineage, line)
                else:
                    # Unloaded first: nothing of a deleted lineage may stay served once its records are gone.
                    try:
                        await self._gateway.retire_line(line)
                    except GatewayError as exc:
                        raise LineageGatewayError(str(exc)) from exc
                    removed = await self._purge.run(lineage, remove_files=state.remove_files)
                    log.info("lineage %s: deletion finished (%s)", lineage, removed)
                finished += 1
            except LineageGatewayError as exc:
                log.warning("lineage %s: the gateway did not retire its line (%s); retrying later", lineage,
                            exc.message)
                break
        return finished

    async def sweep_idle(self, *, now: float | None = None) -> int:
        """Archive up to `IDLE_PER_TICK` lineages with no Task started for `idle_archive_s`; returns how many.
        A lineage still in use (an active Task, a run, a rollout) restarts its idle clock."""
        if self._idle_archive_s is None:
            return 0
        now = self._clock() if now is None else now
        idle = [text(m) or "" for m in await self._redis.zrange(
            keys.LINEAGES_LAST_TASK, "-inf", now - self._idle_archive_s, byscore=True, offset=0, num=IDLE_PER_TICK)]
        archived = 0
        for lineage in idle:
            try:
                await self.archive(lineage, by="idle")
                archived += 1
            except LineageGone:
                await self._fence.write(self._redis, lambda pipe, m=lineage: pipe.zrem(keys.LINEAGES_LAST_TASK, m))
            except Conflict as exc:
                if exc.code in _IN_USE:  # in use now: idle from now on at the earliest
                    await self._fence.write(
                        self._redis, lambda pipe, m=lineage: pipe.zadd(keys.LINEAGES_LAST_TASK, {m: now}, xx=True))
                else:  # archived or being deleted meanwhile: the clock is not needed
                    await self._fence.write(self._redis, lambda pipe, m=lineage: pipe.zrem(keys.LINEAGES_LAST_TASK, m))
            except LineageGatewayError as exc:
                log.warning("idle archive of %s: %s", lineage, exc.message)
                archived += isinstance(exc, UnloadPending)
                break  # the gateway is not answering: the next round tries again
        if archived:
            log.info("idle sweep archived %d lineage(s) with no Task for %d s", archived, self._idle_archive_s)
        return archived

    def start(self) -> None:
        self._stopping = asyncio.Event()
        self._kick.set()  # a new leader finishes what the previous one left at once
        self._task = asyncio.create_task(self._run(), name="lineage-lifecycle")

    async def _run(self) -> None:
        while not self._stopping.is_set():
            self._kick.clear()
            delay = self._interval_s
            try:
                await self.finish_retiring()
                await self.sweep_idle()
                if await self._redis.zcard(keys.LINEAGES_RETIRING):
                    delay = min(delay, RETRY_DELAY_S)
            except asyncio.CancelledError:
                raise
            except LeaseLost as exc:
                log.warning("lineage lifecycle stops: %s", exc)
                return
            except Exception:
                log.exception("lineage lifecycle round failed; retrying")
                delay = min(delay, RETRY_DELAY_S)
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wait(), delay)

    async def _wait(self) -> None:
        stop = asyncio.ensure_future(self._stopping.wait())
        kick = asyncio.ensure_future(self._kick.wait())
        try:
            await asyncio.wait({stop, kick}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            kick.cancel()

    async def stop(self) -> None:
        await stop_loop(self._task, self._stopping)
        self._task = None
