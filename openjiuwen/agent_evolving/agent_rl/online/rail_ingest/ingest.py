"""Server-side rail-v1 ingestion (CONTRACT §2.9, §4.6, D15).

A batch carries tokenized samples of one rail trajectory. Valid samples are staged per session in
`pending_judge:{s}:{traj}:{step}` (the staged encoding of a packed sample) indexed by `pending_judge_session:{s}`
(score = staging time), both with the trajectory retention as TTL. A later batch's `prev_feedback` pops the
session's earliest staged sample and judges it with that feedback; `session_done` pops every staged sample of the
session and judges them with "". Pops are atomic, so concurrent uploads never judge one sample twice. Judged samples
go to the trajectory store as `pending`; a sample whose judging fails is dropped and reported.

A pop moves the entries from the session index to `rail:inflight:{s}` and leaves the staged samples in place; they
are deleted only once judged and stored (or reported as failed). An upload that fails on the way (a Redis or store
error) puts its entries back, and startup puts back whatever a crash left in flight (as does a worker that replaces a
dead one, for the sessions that worker held: `rail:inflight_owners`), so the client's retry of the same batch pops
the same samples again: a crash never loses a staged sample nor pairs its feedback with the next.
Each sample's checks and its sample document are `samples.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common import ids
from ...common.policy_names import BASE_POLICY
from ..errors import InvalidInput, JudgeFailed
from ..store import keys
from ..store.codec import PackedSample
from ..store.sample_publisher import SamplePublisher
from ..store.tx import transact
from ..workers.membership import SOLO, Membership
from .samples import INVALID, PROTOCOL_VERSION, BatchContext, StagedSample, build_rail_sample

if TYPE_CHECKING:
    from ..judge import Judge
    from .jsonl_copy import RailRecorder

log = logging.getLogger("openjiuwen.agent_rl.online.rail")

_FEEDBACK_KEYS = ("raw_user_text", "text", "feedback")
# Staging scores of one batch are spaced by this much so that its samples keep their batch order (equal scores
# would fall back to member order, where "t:10" sorts before "t:2").
_STAGING_STEP_S = 1e-6

TAG_PREV_FEEDBACK = "prev_feedback"
TAG_SESSION_DONE = "session_done"
TAG_SESSION_FLUSH = "session_flush"


@dataclass(frozen=True, slots=True)
class _Batch(BatchContext):
    samples: list[Any]
    feedback: str | None  # None: no prev_feedback in this batch
    session_done: bool


@dataclass(slots=True)
class _Outcome:
    """What one upload came to: samples judged, judge failures, and the per-sample errors the answer lists."""

    judged: int = 0
    failed: int = 0
    errors: list[dict[str, str]] = field(default_factory=list)


class RailIngestor:
    """Validates, stages and judges rail-v1 batches for the service's own model."""

    def __init__(
        self,
        redis: Redis,
        samples: SamplePublisher,
        judge: Judge | None,
        *,
        model_id: str,
        retention_seconds: int,
        recorder: RailRecorder | None = None,
        membership: Membership = SOLO,
    ) -> None:
        self._recorder = recorder  # the optional JSONL copy of stored samples (`record_dir`, jsonl_copy.py)
        self._membership = membership  # whose in-flight pops are left from a dead worker
        self._redis = redis
        self._samples = samples
        self._judge = judge
        self._model_id = model_id
        self._retention_s = retention_seconds

    async def ingest(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Process one upload; returns the `result` object of §2.9. Raises InvalidInput for a 400."""
        parsed = self._parse_batch(batch)
        if self._judge is None:
            raise InvalidInput("judge_not_configured", "rail-v1 uploads need a Judge and none is configured")
        valid: list[StagedSample] = []
        outcome = _Outcome()
        errors = outcome.errors
        seen_steps: set[int] = set()
        policy_version = self._policy_version(parsed.trajectory_meta)
        for position, raw in enumerate(parsed.samples):
            try:
                staged = build_rail_sample(
                    parsed, raw, position, model_id=self._model_id, policy_version=policy_version,
                    seen_steps=seen_steps,
                )
            except InvalidInput as exc:
                sample_id = _fallback_sample_id(parsed.trajectory_id, raw, position)
                errors.append({"sample_id": sample_id, "error": exc.message})
                continue
            seen_steps.add(staged.step)
            valid.append(staged)
        if parsed.samples and not valid:
            # Nothing happens on a rejected batch: no pop, no staging.
            raise InvalidInput(INVALID, errors[0]["error"])

        if parsed.feedback is not None:
            popped = await self._pop(parsed.session_id, first_only=True)
            await self._settle(parsed.session_id, popped, parsed.feedback, outcome, TAG_PREV_FEEDBACK)
        if valid:
            await self._stage(parsed.session_id, parsed.trajectory_id, valid)
        flushed = 0
        if parsed.session_done:
            popped = await self._pop(parsed.session_id, first_only=False)
            flushed = len(popped)
            await self._settle(parsed.session_id, popped, "", outcome, TAG_SESSION_DONE)
        return {
            "protocol_version": PROTOCOL_VERSION,
            "session_id": parsed.session_id,
            "trajectory_id": parsed.trajectory_id,
            "accepted": len(valid),
            "rejected": len(parsed.samples) - len(valid),
            "judged": outcome.judged,
            "judge_failed": outcome.failed,
            "session_flushed": flushed,
            "errors": errors,
        }

    # ------------------------------------------------------------------ batch validation

    def _parse_batch(self, batch: dict[str, Any]) -> _Batch:
        if not isinstance(batch, dict):
            raise InvalidInput(INVALID, "batch must be a JSON object")
        if batch.get("protocol_version") != PROTOCOL_VERSION:
            raise InvalidInput(INVALID, f"protocol_version must be {PROTOCOL_VERSION!r}")
        for name in ("session_id", "trajectory_id"):
            if name not in batch:
                raise InvalidInput(INVALID, f"missing field: {name}")
            if not ids.is_token_id(batch[name]):
                raise InvalidInput(INVALID, f"{name} must match [A-Za-z0-9._:-]{{1,128}}")
        if "samples" not in batch:
            raise InvalidInput(INVALID, "missing field: samples")
        samples = batch["samples"]
        if not isinstance(samples, list):
            raise InvalidInput(INVALID, "samples must be a list")
        model_id = batch.get("model_id")
        if model_id is not None and model_id != self._model_id:
            raise InvalidInput(INVALID, f"model_id does not match the service model {self._model_id!r}")
        session_done = batch.get("session_done")
        if session_done is not None and not isinstance(session_done, bool):
            raise InvalidInput(INVALID, "session_done must be a boolean")
        trajectory_meta = batch.get("trajectory_meta")
        if trajectory_meta is not None and not isinstance(trajectory_meta, dict):
            raise InvalidInput(INVALID, "trajectory_meta must be an object")
        for name in ("user_id", "tenant_id", "instruction_text"):
            if batch.get(name) is not None and not isinstance(batch[name], str):
                raise InvalidInput(INVALID, f"{name} must be a string")
        return _Batch(
            session_id=batch["session_id"],
            trajectory_id=batch["trajectory_id"],
            samples=samples,
            feedback=_feedback_text(batch.get("prev_feedback")),
            session_done=bool(session_done),
            trajectory_meta=trajectory_meta or {},
            user_id=batch.get("user_id"),
            tenant_id=batch.get("tenant_id"),
            instruction_text=batch.get("instruction_text"),
        )

    def _policy_version(self, trajectory_meta: dict[str, Any]) -> str:
        version = trajectory_meta.get("policy_version")
        return version if ids.is_policy_name(version, self._model_id) else BASE_POLICY

    # ------------------------------------------------------------------ staging and atomic pops

    async def _stage(self, session_id: str, trajectory_id: str, samples: list[StagedSample]) -> None:
        index = keys.pending_judge_session(session_id)
        # A retried upload must not re-judge what is already stored: skip samples the store already holds.
        async with self._redis.pipeline(transaction=False) as pipe:
            for staged in samples:
                pipe.exists(keys.traj(staged.sample_id))
            stored = await pipe.execute()
        fresh = [staged for staged, exists in zip(samples, stored) if not exists]
        if not fresh:
            return

        async def body(pipe: Pipeline) -> None:
            last = await pipe.zrange(index, -1, -1, withscores=True)
            base = max(time.time(), last[0][1] + _STAGING_STEP_S if last else 0.0)
            # Staged sample and its session index entry appear together (the pop relies on both), with TTLs.
            pipe.multi()
            for n, staged in enumerate(fresh):
                pipe.set(
                    keys.pending_judge(session_id, trajectory_id, staged.step),
                    staged.sample.encode_staged(),
                    ex=self._retention_s,
                )
                # NX: a re-uploaded sample keeps its original place in the session order.
                pipe.zadd(index, {staged.sample_id: base + n * _STAGING_STEP_S}, nx=True)
            pipe.expire(index, self._retention_s)
            await pipe.execute()

        await transact(self._redis, body, index)

    async def _pop(self, session_id: str, *, first_only: bool) -> list[StagedSample]:
        """Atomically take the session's earliest staged sample (or all of them), in staging order, into the
        session's in-flight set; `_settle` deletes them once stored.

        WATCH on the session index makes two concurrent pops of one member impossible: the loser's EXEC fails and
        it reads the index again. Entries whose sample expired are dropped on the way."""
        index, inflight = keys.pending_judge_session(session_id), keys.rail_inflight(session_id)
        while True:

            async def body(pipe: Pipeline) -> list[tuple[str, int, bytes | None]]:
                members = await pipe.zrange(index, 0, 0 if first_only else -1, withscores=True)
                entries = [(m.decode(), score, *_parse_member(m.decode())) for m, score in members]
                if not entries:
                    return []
                # CONTRACT §5.3 "rail pop", made crash-safe: the entries leave the session index for the in-flight
                # set in one EXEC, so no other pop takes them and a crash cannot lose them (the staged samples stay).
                pipe.multi()
                for _, _, trajectory_id, step in entries:
                    if trajectory_id is not None:
                        pipe.get(keys.pending_judge(session_id, trajectory_id, step))
                pipe.zrem(index, *(member for member, _, _, _ in entries))
                pipe.zadd(inflight, {member: score for member, score, _, _ in entries})
                pipe.expire(inflight, self._retention_s)
                pipe.sadd(keys.RAIL_INFLIGHT_SESSIONS, session_id)
                pipe.hset(keys.RAIL_INFLIGHT_OWNERS, session_id, self._membership.member)
                replies = iter(await pipe.execute())
                return [
                    (member, step, next(replies) if trajectory_id is not None else None)
                    for member, _, trajectory_id, step in entries
                ]

            popped = await transact(self._redis, body, index)
            out = [StagedSample(member, step, PackedSample.decode_staged(blob)) for member, step, blob in popped if blob]
            gone = [member for member, _, blob in popped if not blob]
            if gone:
                await self._release(session_id, gone)
            if out or not popped or not first_only:
                return out
            # The earliest entry had expired (or was unreadable); prev_feedback belongs to the next one.

    async def _settle(self, session_id: str, popped: list[StagedSample], feedback: str, outcome: _Outcome,
                      last_tag: str) -> None:
        """Judge and store popped samples, then delete them; on any error put them back for the client's retry."""
        if not popped:
            return
        members = [staged.sample_id for staged in popped]
        try:
            await self._judge_and_store(popped, feedback, outcome, last_tag)
        except BaseException:
            await asyncio.shield(self._restore(session_id, members))
            raise
        await self._release(session_id, members)

    async def _release(self, session_id: str, members: list[str]) -> None:
        """Stored (or reported as failed): the popped samples and their in-flight entries go together."""
        inflight = keys.rail_inflight(session_id)
        staged_keys = [keys.pending_judge(session_id, t, step) for t, step in map(_parse_member, members) if t]

        async def body(pipe: Pipeline) -> None:
            left = await pipe.zcard(inflight)
            pipe.multi()
            if staged_keys:
                pipe.delete(*staged_keys)
            pipe.zrem(inflight, *members)
            if left <= len(members):  # nothing else of this session in flight: off the recovery list
                pipe.srem(keys.RAIL_INFLIGHT_SESSIONS, session_id)
                pipe.hdel(keys.RAIL_INFLIGHT_OWNERS, session_id)
            await pipe.execute()

        await transact(self._redis, body, inflight)

    async def _restore(self, session_id: str, members: list[str] | None = None, *, owner: bytes | None = None) -> int:
        """Put popped entries (all of the session's when `members` is None) back into the session index at their
        original place, so that the next pop takes them again. Returns how many went back. With `owner` (recovery
        of a dead worker's pops), only while that worker is still the session's last popper: a live worker that
        popped the session meanwhile settles its own entries."""
        index, inflight = keys.pending_judge_session(session_id), keys.rail_inflight(session_id)

        async def body(pipe: Pipeline) -> int:
            if owner is not None and await pipe.hget(keys.RAIL_INFLIGHT_OWNERS, session_id) != owner:
                return 0
            entries = await pipe.zrange(inflight, 0, -1, withscores=True)
            wanted = None if members is None else set(members)
            back = {m.decode(): score for m, score in entries if wanted is None or m.decode() in wanted}
            left = len(entries) - len(back)
            pipe.multi()
            if back:
                pipe.zadd(index, back)
                pipe.expire(index, self._retention_s)
                pipe.zrem(inflight, *back)
            if left == 0:
                pipe.srem(keys.RAIL_INFLIGHT_SESSIONS, session_id)
                pipe.hdel(keys.RAIL_INFLIGHT_OWNERS, session_id)
            await pipe.execute()
            return len(back)

        watched = (inflight, keys.RAIL_INFLIGHT_OWNERS) if owner is not None else (inflight,)
        return await transact(self._redis, body, *watched)

    async def recover(self) -> int:
        """Startup, and a worker replacing a dead one: every rail sample a crash left in flight goes back to its
        session's staging order, unless another live worker holds the session's pop (it settles it itself)."""
        restored = 0
        for raw in await self._redis.smembers(keys.RAIL_INFLIGHT_SESSIONS):
            session_id = raw.decode()
            owner = await self._redis.hget(keys.RAIL_INFLIGHT_OWNERS, session_id)
            if await self._membership.alive(owner.decode() if owner else None):
                continue
            restored += await self._restore(session_id, owner=owner) if owner else await self._restore(session_id)
        if restored:
            log.info("recovery put %d in-flight rail sample(s) back into staging", restored)
        return restored

    # ------------------------------------------------------------------ judging

    async def _judge_and_store(self, popped: list[StagedSample], feedback: str, outcome: _Outcome,
                               last_tag: str) -> None:
        if not popped:
            return
        tags = [TAG_SESSION_FLUSH] * (len(popped) - 1) + [last_tag]
        results = await asyncio.gather(*(self._judge_one(s, feedback, tag) for s, tag in zip(popped, tags)))
        judged: list[PackedSample] = []
        for staged, result in zip(popped, results):
            if isinstance(result, str):
                outcome.failed += 1
                outcome.errors.append({"sample_id": staged.sample_id, "error": result})
            else:
                judged.append(result)
        if judged:
            outcome.judged += len(judged)
            inserted = await self._samples.insert_if_absent(judged)
            if self._recorder is not None and inserted:
                by_id = {str(s.meta["sample_id"]): s for s in reversed(judged)}  # the first of a duplicate id won
                await self._recorder.record([by_id[sample_id] for sample_id in inserted])

    async def _judge_one(self, staged: StagedSample, feedback: str, tag: str) -> PackedSample | str:
        """The judged sample, or the failure text when the Judge could not score it."""
        assert self._judge is not None  # checked before anything was popped
        meta = staged.sample.meta
        try:
            result = await self._judge.score(meta["request"], meta["response"], feedback)
        except JudgeFailed as exc:
            log.warning("rail sample %s not judged: %s", staged.sample_id, exc.message)
            return f"judge failed: {exc.message}"
        meta["judge"] = result.as_sample_judge(tag)
        return staged.sample


def _feedback_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        for name in _FEEDBACK_KEYS:
            if isinstance(value.get(name), str):
                return value[name]
    raise InvalidInput(INVALID, "prev_feedback must be a string or an object with raw_user_text, text or feedback")


def _parse_member(member: str) -> tuple[str | None, int]:
    """(trajectory id, step) of a session index member `<trajectory_id>:<step>`; (None, 0) when malformed."""
    trajectory_id, _, step = member.rpartition(":")
    if not ids.is_token_id(trajectory_id) or not step.isdigit() or not step.isascii():
        return None, 0
    return trajectory_id, int(step)


def _fallback_sample_id(trajectory_id: str, raw: Any, position: int) -> str:
    step = raw.get("step_index") if isinstance(raw, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        step = position
    return f"{trajectory_id}:{step}"
