"""The capture ledger: a capture's reservation at `:before`, its commit with its staged samples at `:after`, its
discard, each one Lua script round trip (scripts.py), and the hook path's in-process memories (the Task facts and
the open-capture hints) that spare it reads. Each method states the invariant of CONTRACT §5.4 it keeps; methods
raise domain errors (NotFound, Conflict) and never decide HTTP statuses. Task records themselves are
tasks/registry.py's; turn publication is turn_ledger.py's."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NoReturn

from redis.asyncio import Redis

from .. import events
from ..errors import Conflict, NotFound
from ..store import keys
from ..store.codec import PackedSample, text
from ..store.tx import MAX_WATCH_RETRIES, RedisContention
from ..tasks.signals import TaskSignals
from ..tasks.task_records import CaptureMeta, CaptureStatus, Task
from ...common.ids import now_iso, parse_iso_epoch
from . import scripts

log = logging.getLogger("openjiuwen.agent_rl.online.tasks")

# Bounds of the hook path's in-process memories (`TaskRegistry.task_facts`, the open-capture hints of `commit`):
# past them the oldest entries go, and a hook of a forgotten Task or capture costs one more round trip.
FACTS_CACHE_SIZE = 4096
OPEN_HINTS_SIZE = 4096


class AbortingConflict(Conflict):
    """A conflict after which the Task must be aborted `capture_failed` (closed or closing turn)."""


class StaleTask(Exception):
    """The Task id names another Task than the facts a hook validated against (its record expired and the id was
    started again). Nothing was written; the hook is redone with `task`, the Task as it is now."""

    def __init__(self, task: Task) -> None:
        super().__init__(f"RL Task {task.rl_task_id} is another Task now")
        self.task = task


class ReserveOutcome(Enum):
    RESERVED = "reserved"
    IDEMPOTENT = "idempotent"
    PUBLISH_CURRENT = "publish_current"  # delayed mode: the current turn must be published first


@dataclass(frozen=True, slots=True)
class Reservation:
    outcome: ReserveOutcome
    current_turn: str | None = None  # set with PUBLISH_CURRENT


class CaptureLedger:
    def __init__(self, redis: Redis, *, signals: TaskSignals) -> None:
        self._redis = redis
        self.signals = signals  # the registry's: a commit or discard wakes what waits on the Task
        self._scripts = scripts.CaptureScripts(redis)
        # The hook path's memories (`task_facts`, `commit`): caches of facts the scripts verify, never the truth.
        self._facts: dict[str, Task] = {}
        self._open_hints: dict[tuple[str, str], bytes] = {}  # (task, capture) → the open metadata we reserved

    async def task_facts(self, rl_task_id: str) -> tuple[Task, bool]:
        """The Task a hook validates against, and whether it came from this process's memory.

        Only the fields a Task never changes may be used from it (`Task.spec()`, `rl_task_id`, `created_at`): a
        Task's spec is fixed at start (a start with another spec is a conflict), so they are facts of the id for as
        long as its record exists. `status` may be stale and is never read from it: the capture scripts read the
        live status, and check existence and identity (`created_at`) themselves, so a remembered Task never decides
        anything the record contradicts, whichever process changed it. NotFound for an unknown Task (not
        remembered)."""
        task = self._facts.get(rl_task_id)
        if task is not None:
            return task, True
        raw = await self._redis.get(keys.task(rl_task_id))
        if raw is None:
            raise NotFound("RL Task not found")
        return self._remember(Task.from_json(raw)), False

    async def confirm(self, task: Task) -> None:
        """Before answering an error found with remembered facts: the Task must still exist (NotFound, as the read
        that was skipped would have answered first) and be the same Task (StaleTask)."""
        raw = await self._redis.get(keys.task(task.rl_task_id))
        if raw is None:
            self._facts.pop(task.rl_task_id, None)
            raise NotFound("RL Task not found")
        current = Task.from_json(raw)
        if current.created_at != task.created_at:
            raise StaleTask(self._remember(current))

    def _remember(self, task: Task) -> Task:
        facts = self._facts
        if task.rl_task_id not in facts and len(facts) >= FACTS_CACHE_SIZE:
            del facts[next(iter(facts))]  # the oldest entry: a forgotten Task costs one read at its next hook
        facts[task.rl_task_id] = task
        return task

    def _hint_open(self, t: str, capture_id: str, meta_json: bytes) -> None:
        hints = self._open_hints
        key = (t, capture_id)
        if key not in hints and len(hints) >= OPEN_HINTS_SIZE:
            del hints[next(iter(hints))]
        hints[key] = meta_json

    def reserved_fingerprint(self, rl_task_id: str, capture_id: str, turn_id: str | None) -> str | None:
        """The request fingerprint this process stored when it reserved the capture at `:before`, while the capture is
        open for `turn_id` as far as this process knows (its own reservation hint; no Redis read); else None. A hint
        is no proof: the commit script still checks the stored record."""
        hint = self._open_hints.get((rl_task_id, capture_id))
        if hint is None:
            return None
        meta = CaptureMeta.from_json(hint)
        if meta.status != CaptureStatus.OPEN or meta.agent_turn_id != turn_id:
            return None
        return meta.request_fingerprint

    def _task_reply(self, t: str, reply: list[Any]) -> NoReturn:
        """NOT_FOUND and TASK_CHANGED, the answers every capture script may give before deciding anything."""
        if reply[0] == scripts.TASK_CHANGED:
            raise StaleTask(self._remember(Task.from_json(reply[1])))
        self._facts.pop(t, None)
        raise NotFound("RL Task not found")

    async def reserve(
        self, task: Task, capture_id: str, turn_id: str | None, request_fingerprint: str
    ) -> Reservation:
        """Reserve an open capture (CONTRACT §4.2 before, §4.3 for delayed mode), in one script round trip
        (`capture_scripts.RESERVE`).

        Invariant 2: the metadata, the `captures` set and the open set change together. Invariant 7: a closed
        turn never accepts a capture, and the current turn only moves forward through `advance_turn`."""
        t = task.rl_task_id
        script_keys = [keys.task(t), keys.capture(t, capture_id), keys.captures(t), keys.open_captures(t),
                       keys.task_events(t)]
        delayed = task.delayed  # reward_mode never changes for a Task (the script checks it is the same Task)
        if delayed:
            assert turn_id is not None
            script_keys += [
                keys.turn_current(t), keys.turn_transition(t), keys.turns_closed(t), keys.turn_publish(t, turn_id),
            ]
        meta = CaptureMeta(capture_id, turn_id, request_fingerprint, None, CaptureStatus.OPEN, now_iso())
        meta_json = meta.to_json()
        reply = await self._scripts.reserve(keys=script_keys, args=[
            task.created_at, capture_id, turn_id or "", meta_json, meta.created_at,
            events.encode_data({"capture_id": capture_id, "agent_turn_id": turn_id}), "1" if delayed else "0",
        ])
        code = reply[0]
        if code == scripts.DONE:
            self._hint_open(t, capture_id, meta_json)
            return Reservation(ReserveOutcome.RESERVED)
        if code == scripts.CAPTURE_EXISTS:
            existing = CaptureMeta.from_json(reply[1])
            if existing.agent_turn_id == turn_id and existing.request_fingerprint == request_fingerprint:
                if existing.status == CaptureStatus.OPEN:
                    self._hint_open(t, capture_id, reply[1])
                return Reservation(ReserveOutcome.IDEMPOTENT)
            raise Conflict("capture_id already used with different input")
        if code == scripts.INACTIVE:
            raise Conflict("RL Task is not active")
        if code == scripts.TURN_CLOSED:
            raise AbortingConflict(f"turn {turn_id} is closed")
        if code == scripts.TURN_CLOSING:
            raise AbortingConflict(f"turn {turn_id} is closing")
        if code == scripts.TURN_WAITING:
            raise Conflict(f"turn {text(reply[1])} is already waiting for {text(reply[2])}")
        if code == scripts.PUBLISH_CURRENT:
            return Reservation(ReserveOutcome.PUBLISH_CURRENT, current_turn=text(reply[1]))
        self._task_reply(t, reply)

    async def commit(
        self,
        task: Task,
        capture_id: str,
        turn_id: str | None,
        request_fingerprint: str,
        response_fingerprint: str,
        samples: Sequence[PackedSample] | None,
    ) -> bool:
        """open → committed with its staged samples (one, or one per choice of an `n` > 1 answer); returns False for
        an idempotent repeat.

        `samples` may be None only when the caller knows the capture is already committed. Invariants 2 and 3:
        the capture leaves the open set, joins the committed (and turn) set and gains its staged samples at once.

        The staged sample carries `completion_latency_ms` (this commit's time minus the reservation's `created_at`),
        so it is encoded here from the capture metadata the decision is based on, and the script
        (`capture_scripts.COMMIT`) writes only while the stored metadata is still exactly those bytes and the Task
        active: the check WATCH made. The metadata comes from this process's own reservation when it made one (one
        round trip); else the first script call only reads it (two). A commit that finds the capture changed under
        it decides again from what the script returned, as a lost WATCH retried."""
        t = task.rl_task_id
        capture_key = keys.capture(t, capture_id)
        script_keys = [keys.task(t), capture_key, keys.staged(t, capture_id), keys.open_captures(t),
                       keys.committed_captures(t), keys.task_events(t)]
        if turn_id is not None:
            script_keys.append(keys.turn_captures(t, turn_id))
        event: dict[str, Any] = {"capture_id": capture_id, "agent_turn_id": turn_id}
        if samples and samples[0].meta.get("sampling"):
            event["sampling"] = samples[0].meta["sampling"]  # the Task's timeline shows what each capture sampled at
        if samples and len(samples) > 1:
            event["samples"] = len(samples)
        event_data = events.encode_data(event)
        expected = self._open_hints.get((t, capture_id))
        for _ in range(MAX_WATCH_RETRIES):
            args: list[Any] = [task.created_at, b"", b"", b"", capture_id, b"", b""]
            if expected is not None and samples:
                meta = CaptureMeta.from_json(expected)
                if (meta.status == CaptureStatus.OPEN and meta.agent_turn_id == turn_id
                        and meta.request_fingerprint == request_fingerprint):
                    now = now_iso()
                    # Completion latency: from the reservation at `:before` to this commit (per-version evaluation).
                    latency = round(max(0.0, (parse_iso_epoch(now) - parse_iso_epoch(meta.created_at)) * 1000.0), 3)
                    for sample in samples:
                        sample.meta["completion_latency_ms"] = latency
                    committed = CaptureMeta(
                        meta.capture_id, meta.agent_turn_id, meta.request_fingerprint, response_fingerprint,
                        CaptureStatus.COMMITTED, meta.created_at, len(samples) if len(samples) > 1 else None,
                    )
                    args = [task.created_at, expected, committed.to_json(), PackedSample.encode_staged_all(samples),
                            capture_id, now, event_data]
            reply = await self._scripts.commit(keys=script_keys, args=args)
            code = reply[0]
            if code == scripts.DONE:
                self._open_hints.pop((t, capture_id), None)
                self.signals.notify(t)
                log.debug("capture %s of task %s committed", capture_id, t,
                          extra={"rl_task_id": t, "capture_id": capture_id, "agent_turn_id": turn_id})
                return True
            if code != scripts.STATE:
                self._task_reply(t, reply)
            # Not written: decide from the capture as stored, in the order the contract gives (§4.2 after).
            raw, active = reply[1], reply[2] == 1
            if raw is None:
                raise Conflict("capture has no matching before")
            meta = CaptureMeta.from_json(raw)
            if meta.agent_turn_id != turn_id:
                raise Conflict("agent_turn_id differs from the one seen at before")
            if meta.request_fingerprint != request_fingerprint:
                raise Conflict("request differs from the one seen at before")
            if meta.status == CaptureStatus.COMMITTED:
                self._open_hints.pop((t, capture_id), None)
                if meta.response_fingerprint == response_fingerprint:
                    return False
                raise Conflict("capture already committed with a different response")
            if not active:
                raise Conflict("RL Task is not active")
            if not samples:
                raise Conflict("capture is not committed")
            expected = raw  # open, same input, Task active: commit it if it is still exactly this record
        raise RedisContention("commit kept finding its capture changed")

    async def discard(self, rl_task_id: str, capture_id: str, turn_id: str | None) -> bool:
        """Drop an open capture (True when dropped), in one script round trip (`capture_scripts.DISCARD`). Unknown
        capture or inactive Task: no-op. Invariant 2 as in `reserve`."""
        t = rl_task_id
        reply = await self._scripts.discard(
            keys=[keys.task(t), keys.capture(t, capture_id), keys.captures(t), keys.open_captures(t),
                  keys.task_events(t)],
            args=[turn_id or "", capture_id, now_iso(),
                  events.encode_data({"capture_id": capture_id, "agent_turn_id": turn_id})],
        )
        code = reply[0]
        if code == scripts.DONE:
            self._open_hints.pop((t, capture_id), None)
            self.signals.notify(t)
            return True
        if code == scripts.NO_CAPTURE:
            return False
        if code == scripts.COMMITTED:
            raise Conflict("capture is already committed")
        if code == scripts.OTHER_TURN:
            raise Conflict("agent_turn_id differs from the one seen at before")
        self._task_reply(t, reply)
