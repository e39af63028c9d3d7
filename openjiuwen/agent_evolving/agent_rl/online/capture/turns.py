"""Publication of a delayed-feedback turn through the Judge (CONTRACT §4.3).

One caller claims a turn (`publishing`, naming its worker process), scores every staged sample of the turn
concurrently, inserts them into the trajectory store and completes atomically; everyone else waits, event-driven,
under one deadline. A claim whose process died (a worker SIGKILLed; workers/membership.py) is taken over by the next
caller instead of waiting for the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import TYPE_CHECKING

from ..errors import Conflict, JudgeFailed
from .. import faults
from ..store.codec import PackedSample
from ..store.sample_deletion import SampleDeletion
from ..store.sample_publisher import SamplePublisher
from ...common.wire.task_states import FinishReason
from ..tasks.task_records import Task, TurnPublication
from ..tasks.registry import TaskRegistry
from .turn_ledger import TurnLedger
from ..store.fence import UNFENCED, Fence
from ..workers.membership import SOLO, Membership

if TYPE_CHECKING:
    from ..judge import Judge
    from ..metrics import ServiceMetrics

log = logging.getLogger("openjiuwen.agent_rl.online.turns")


class PublicationTimeout(Conflict):
    """The turn could not be published before the deadline; the Task has been aborted."""


class TurnPublisher:
    def __init__(
        self, registry: TaskRegistry, turns: TurnLedger, samples: SamplePublisher, deletion: SampleDeletion,
        judge: "Judge | None", *, metrics: "ServiceMetrics | None" = None, membership: Membership = SOLO,
    ) -> None:
        self._registry = registry  # a Task's abort and its change signals
        self._turns = turns
        self._membership = membership
        self._samples = samples
        self._deletion = deletion  # rolls a failed publication back
        self._judge = judge
        self._metrics = metrics
        # One claim-and-publish at a time per (Task, turn) in this process; a lock nobody holds or awaits goes away.
        self._locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()

    async def publish(self, task: Task, turn_id: str, *, feedback: str, tag: str, deadline: float | None) -> None:
        """Publish `turn_id` once. `deadline` (loop time) bounds waiting for open captures and for another
        publisher; None means do not wait at all (finish: open captures are a conflict right away)."""
        t = task.rl_task_id
        loop = asyncio.get_running_loop()
        lock = self._locks.setdefault((t, turn_id), asyncio.Lock())
        while True:
            if deadline is None and lock.locked():
                raise Conflict("turn publication in progress")
            try:
                async with asyncio.timeout(None if deadline is None else max(0.0, deadline - loop.time())):
                    await lock.acquire()
            except TimeoutError:
                state = TurnPublication.PUBLISHING  # still held by this process's publisher when the deadline came
            else:
                try:
                    me = self._membership.member
                    state = await self._turns.claim_publish(t, turn_id, owner=me)
                    if state == TurnPublication.PUBLISHING:
                        # No publisher of this process holds the turn (we hold its lock). A claim of another live
                        # worker is waited for; one of a dead process (a crash, or this process failing even to
                        # roll back during a Redis outage) is taken over instead of leaving the turn stuck.
                        holder = await self._turns.publisher(t, turn_id)
                        if not await self._membership.alive(holder) and await self._turns.take_over_publish(
                                t, turn_id, dead=holder, owner=me):
                            await self._take_over(t, turn_id)
                            state = TurnPublication.CLAIMED
                    if state == TurnPublication.CLAIMED:
                        await self._publish_claimed(task, turn_id, feedback=feedback, tag=tag)
                        return
                finally:
                    lock.release()
            if state == TurnPublication.PUBLISHED:
                return
            if state == TurnPublication.FAILED:
                raise Conflict(f"publication of turn {turn_id} failed")
            if deadline is None:
                raise Conflict(
                    "RL Task has open captures" if state == TurnPublication.OPEN else "turn publication in progress"
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                if state == TurnPublication.PUBLISHING:
                    # Its publisher died or hangs (a crash, a Redis outage during its roll-back): nothing of the
                    # turn may stay visible once the Task is aborted.
                    await self.abandon(t)
                await self._registry.abort(t, FinishReason.CAPTURE_FAILED)
                raise PublicationTimeout("turn publication timed out")
            await self._registry.signals.wait(t, remaining)

    async def _publish_claimed(self, task: Task, turn_id: str, *, feedback: str, tag: str) -> None:
        t = task.rl_task_id
        inserted: list[str] = []
        started = time.perf_counter()
        try:
            staged = await self._turns.turn_staged(t, turn_id)
            samples = [sample for _, blob in staged for sample in PackedSample.decode_staged_all(blob)]
            if samples:
                if self._judge is None:
                    raise JudgeFailed("no Judge is configured")
                judge = self._judge
                results = await asyncio.gather(
                    *(judge.score(s.meta["request"], s.meta["response"], feedback) for s in samples)
                )
                for sample, result in zip(samples, results):
                    sample.meta["judge"] = result.as_sample_judge(tag)
                inserted = await self._samples.insert_if_absent(samples)
                faults.reached("turn.inserted")
            reward = sum(r.score for r in results) / len(results) if samples else None
            await self._turns.complete_publish(t, turn_id, [c for c, _ in staged], reward=reward,
                                                  owner=self._membership.member, sample_count=len(samples))
            if self._metrics is not None:
                self._metrics.turn_published(time.perf_counter() - started)
        except BaseException as exc:
            # Roll back: nothing of a failed publication stays visible, and the Task cannot continue.
            await asyncio.shield(self._roll_back(t, turn_id, inserted, exc))
            raise

    async def _take_over(self, t: str, turn_id: str) -> None:
        """Remove what a failed publisher inserted (still pending) before publishing the turn again."""
        ids = await self._turns.turn_capture_ids(t, turn_id)
        removed = await self._deletion.delete_pending(ids) if ids else 0
        log.warning("taking over the publication of turn %s of task %s (%d stale sample(s) removed)",
                    turn_id, t, removed)

    async def abandon(self, rl_task_id: str, *, fence: Fence = UNFENCED) -> list[str]:
        """Roll back a publication whose publisher is gone: the current turn, if still `publishing`, loses the
        samples it inserted (those still pending) and becomes `failed`. Used before aborting a Task whose publisher
        crashed (startup recovery, through the leader's `fence`) or never finished (publication deadline). Returns
        the deleted sample ids.

        Invariant 4 read both ways: a turn's samples exist only once it is `published`."""
        current, _ = await self._turns.turn_state(rl_task_id)
        if current is None or await self._turns.publish_state(rl_task_id, current) != TurnPublication.PUBLISHING:
            return []
        ids = await self._turns.turn_capture_ids(rl_task_id, current)
        deleted = await self._deletion.delete_pending(ids, fence=fence) if ids else 0
        await self._turns.fail_publish(rl_task_id, current, fence=fence)
        log.warning("abandoned the publication of turn %s of task %s (%d sample(s) rolled back)",
                    current, rl_task_id, deleted)
        return ids

    async def _roll_back(self, t: str, turn_id: str, inserted: list[str], exc: BaseException) -> None:
        log.warning("publication of turn %s of task %s failed: %s", turn_id, t, exc,
                    extra={"rl_task_id": t, "agent_turn_id": turn_id})
        holder = await self._turns.publisher(t, turn_id)
        if holder is not None and holder != self._membership.member:
            # Taken over by another worker while this one was thought dead: the turn and what is inserted are its.
            log.warning("publication of turn %s of task %s was taken over by %s", turn_id, t, holder)
            return
        if inserted:
            await self._deletion.delete_pending(inserted)
        await self._turns.fail_publish(t, turn_id)
        await self._registry.abort(t, FinishReason.CAPTURE_FAILED)
