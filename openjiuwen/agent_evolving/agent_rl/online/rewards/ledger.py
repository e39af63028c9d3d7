"""Reward arrivals and deadline moves in Redis: the only writer of a sample's reward state after publication.

Both operations end with the same transition (`awaiting_rewards → pending` once no source of the policy is open)
and run as WATCH(sample hash) → read → decide → MULTI/EXEC. Watching the hash is enough: every write that changes a
sample's status, index membership or deadline-index entry also writes its hash in the same EXEC (publication,
arrival, deadline move, run claim, rollback), so any concurrent change to the sample fails this EXEC and the
decision is made again on fresh state. Several service processes may therefore attach and sweep at once.

Lines (docs/lineages.md): a sample's reward state lives with its line (hash field `lineage`): its status index,
counters, deadline set and lateness lists are its line's, and it follows its lineage's policy
(`reward_policy.lineages.<name>`). The sweeper visits the default line and, through the due-line hint
`keys.REWARD_DUE_LINES`, only the other lines with a deadline due now: never every registered lineage.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common import ids
from ...common.policy_names import BASE_POLICY
from ..errors import InvalidInput, NotFound
from ...common.ids import InvalidIdentifier
from ..store import keys, prompt_blocks
from ..store.codec import decode_meta, text
from ..store.sample_status import SampleStatus
from ..store.sample_line import SampleLine
from ..store.tx import transact
from ..store.fence import Fence
from .reward_policy import RewardConflict, RewardPolicy, iso_at

LATENCY_WINDOW = 1000  # lateness samples kept per source for the p50/p95 of the stats
_FIELDS = ("status", "rewards", "source", "policy_version", "created_at", "lineage")
_LINES_PER_SWEEP = 100  # non-default lines visited per sweep at most; the rest stay due for the next tick


@dataclass(frozen=True, slots=True)
class SweepResult:
    visited: int = 0
    released: int = 0  # awaiting_rewards → pending
    dropped: int = 0  # removed by a `drop` fallback
    fallbacks: int = 0  # fallbacks applied (skip, default or drop)

    def __add__(self, other: "SweepResult") -> "SweepResult":
        return SweepResult(self.visited + other.visited, self.released + other.released,
                           self.dropped + other.dropped, self.fallbacks + other.fallbacks)


class RewardLedger:
    def __init__(self, redis: Redis, line: SampleLine, policy: RewardPolicy, *, owner: str) -> None:
        self._redis = redis
        self._line = line  # the default line; a sample's own line is found from it
        self._policy = policy
        self._owner = owner
        self._stats_key = keys.traj_stats(owner)
        self._deadlines_key = keys.reward_deadlines(owner)

    def _policy_of(self, line: SampleLine) -> RewardPolicy:
        """The policy of a line's samples; the (unconfigured) top-level one once the policy left the config, so
        samples still waiting from it are released at their next sweep."""
        return line.reward_policy or self._policy

    @property
    def policy(self) -> RewardPolicy:
        return self._policy

    # ------------------------------------------------------------------ arrivals

    async def attach(self, sample_id: str, source: str, score: float, *, now: float | None = None) -> dict[str, Any]:
        """Record `score` from the external `source` on a published sample. Idempotent per (sample, source); a
        different score for a source that arrived is a conflict; a sample claimed by a run or trained refuses it."""
        if source not in self._policy.any_external:
            raise InvalidInput("invalid_reward_source", "source is not an external reward source of the reward policy")
        try:
            key = keys.traj(sample_id)
        except InvalidIdentifier:
            raise NotFound("trajectory not found") from None
        now = time.time() if now is None else now

        async def body(pipe: Pipeline) -> dict[str, Any]:
            row = await pipe.hmget(key, _FIELDS)
            status, raw_state, sample_source, policy_version, created_at, lineage = (text(v) for v in row)
            if status is None:
                raise NotFound("trajectory not found")
            line = self._line.for_lineage(lineage)  # the sample's own line: its indexes, counters, policy
            policy = self._policy_of(line)
            if source not in policy.external:
                raise InvalidInput("invalid_reward_source",
                                   "source is not an external reward source of the reward policy of this sample's "
                                   "lineage")
            if status not in (SampleStatus.AWAITING_REWARDS, SampleStatus.PENDING, SampleStatus.EVALUATION):
                raise RewardConflict(f"sample is {status}: rewards are refused once it is in a Training Run or trained")
            state = (orjson.loads(raw_state) if raw_state
                     else await self._state_before_policy(pipe, key, created_at, policy))
            new = policy.arrive(state, source, score, now)
            if new is None:
                return self._answer(sample_id, source, score, policy, recorded=False, status=status, state=state)
            # Only `awaiting_rewards` moves on an arrival; `pending` and `evaluation` samples keep their status.
            new_status = policy.status(new) if status == SampleStatus.AWAITING_REWARDS else status
            at = ids.now_iso()
            # Invariant 5 and the deadline-index invariant, in the sample's own line: status, index membership,
            # deadline entry and counters move together with the reward state.
            pipe.multi()
            pipe.hset(key, mapping={"rewards": orjson.dumps(new), "updated_at": at})
            if status == SampleStatus.AWAITING_REWARDS:
                self._queue_after_change(
                    pipe, line, sample_id, new, new_status, sample_source, policy_version, created_at, at
                )
            latency_key = keys.reward_latency(line.owner, source)
            pipe.lpush(latency_key, f"{max(0.0, now - float(new['published_at'])):.3f}")
            pipe.ltrim(latency_key, 0, LATENCY_WINDOW - 1)
            pipe.hincrby(line.stats_key, keys.stats_reward_arrived(source), 1)
            await pipe.execute()
            return self._answer(sample_id, source, score, policy, recorded=True, status=new_status, state=new)

        return await transact(self._redis, body, key)

    @staticmethod
    async def _state_before_policy(
        pipe: Pipeline, key: str, created_at: str | None, policy: RewardPolicy
    ) -> dict[str, Any]:
        """A sample published before the policy was configured has no state: start one from its `judge`."""
        doc = decode_meta(await pipe.hget(key, "sample_json"))
        published = ids.parse_iso_epoch(created_at) if created_at else time.time()
        return policy.initial(doc.get("judge"), published)

    def _queue_after_change(
        self,
        pipe: Pipeline,
        line: SampleLine,
        sample_id: str,
        state: dict[str, Any],
        new_status: str,
        source: str | None,
        policy_version: str | None,
        created_at: str | None,
        at: str,
    ) -> None:
        """The common end of an arrival and a deadline move on an `awaiting_rewards` sample of `line`."""
        if new_status == SampleStatus.PENDING:
            line.queue_move(
                pipe, sample_id, old=SampleStatus.AWAITING_REWARDS, new=SampleStatus.PENDING,
                score=ids.parse_iso_epoch(created_at) if created_at else time.time(),
                policy_version=policy_version or BASE_POLICY, at=at,
            )
            pipe.zrem(line.deadlines_key, sample_id)
        else:
            line.queue_deadline(pipe, sample_id, self._policy_of(line).next_deadline(state))

    @staticmethod
    def _answer(
        sample_id: str, source: str, score: float, policy: RewardPolicy, *, recorded: bool, status: str,
        state: dict[str, Any],
    ) -> dict[str, Any]:
        return {
            "trajectory_id": sample_id,
            "source": source,
            "score": score,
            "recorded": recorded,
            "status": status,
            "rewards": policy.view(state),
        }

    # ------------------------------------------------------------------ deadlines

    async def next_deadline(self) -> float | None:
        """The earliest deadline of the default line, or the earliest due-hint of another line (a lower bound)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zrange(self._deadlines_key, 0, 0, withscores=True)
            pipe.zrange(keys.REWARD_DUE_LINES, 0, 0, withscores=True)
            firsts = await pipe.execute()
        scores = [float(first[0][1]) for first in firsts if first]
        return min(scores) if scores else None

    async def sweep_due(self, *, fence: Fence, now: float | None = None, limit: int = 500) -> SweepResult:
        """Apply the fallbacks of every deadline due at `now`, at most `limit` samples, one EXEC per sample, each
        through `fence` (the reward-deadline sweeper's, a leader duty): the default line's and those of the other
        lines whose due-hint is at or before `now` (at most `_LINES_PER_SWEEP` lines; a line is never found by
        scanning the registry). While other lines are due the default line takes at most half of `limit` first,
        the due lines the rest, and the default line whatever they left: a busy default line never starves them."""
        now = time.time() if now is None else now
        due_lines = await self._redis.zrange(
            keys.REWARD_DUE_LINES, "-inf", repr(now), byscore=True, offset=0, num=_LINES_PER_SWEEP
        )
        total = await self._sweep_line(self._line, now, limit // 2 if due_lines else limit, fence)
        for raw in due_lines:
            if total.visited >= limit:
                break
            try:
                line = self._line.for_line(text(raw) or "")
            except (InvalidIdentifier, ValueError):
                # Never written by us; keep the hint clean (a leader write like any other: fenced).
                await fence.write(self._redis, lambda pipe, raw=raw: pipe.zrem(keys.REWARD_DUE_LINES, raw))
                continue
            part = await self._sweep_line(line, now, limit - total.visited, fence)
            # After the line's due samples moved: its entry becomes its earliest remaining deadline, or goes.
            await self._refresh_hint(line, fence)
            total = total + part
        if due_lines and total.visited < limit:  # the share the due lines did not use
            total = total + await self._sweep_line(self._line, now, limit - total.visited, fence)
        return total

    async def _refresh_hint(self, line: SampleLine, fence: Fence) -> None:
        """Reset the line's due-hint entry to the earliest deadline its set holds now, or remove it when the set is
        empty; through the sweeper's fence, so a deposed leader never moves the hint."""

        async def body(pipe: Pipeline) -> None:
            first = await pipe.zrange(line.deadlines_key, 0, 0, withscores=True)
            # Invariant (keys.REWARD_DUE_LINES): the line's deadline set is WATCHed, so a publication's EXEC
            # (deadline + ZADD LT) after this read fails this EXEC and the retry sees it: the hint never ends above
            # a deadline of the line, and an entry is removed only while the set is empty.
            pipe.multi()
            if first:
                pipe.zadd(keys.REWARD_DUE_LINES, {line.owner: first[0][1]})
            else:
                pipe.zrem(keys.REWARD_DUE_LINES, line.owner)
            await pipe.execute()

        await fence.transact(self._redis, body, line.deadlines_key)

    async def _sweep_line(self, line: SampleLine, now: float, limit: int, fence: Fence) -> SweepResult:
        if limit <= 0:  # (a LIMIT count of 0 must not be read as "no limit" anywhere down the line)
            return SweepResult()
        due = await self._redis.zrange(line.deadlines_key, "-inf", repr(now), byscore=True, offset=0, num=limit)
        released = dropped = fallbacks = 0
        for member in due:
            outcome, fired = await self._expire_one(line, text(member) or "", now, fence)
            released += outcome == SampleStatus.PENDING
            dropped += outcome == "dropped"
            fallbacks += fired
        return SweepResult(len(due), released, dropped, fallbacks)

    async def _expire_one(self, line: SampleLine, sample_id: str, now: float, fence: Fence) -> tuple[str, int]:
        try:
            key = keys.traj(sample_id)
        except InvalidIdentifier:
            # Never written by us; keep the index clean.
            await fence.write(self._redis, lambda pipe: pipe.zrem(line.deadlines_key, sample_id))
            return "stale", 0

        async def body(pipe: Pipeline) -> tuple[str, int]:
            row = await pipe.hmget(key, _FIELDS)
            status, raw_state, source, policy_version, created_at, lineage = (text(v) for v in row)
            if status != SampleStatus.AWAITING_REWARDS or line is not self._line.for_lineage(lineage):
                # Deadline-index invariant: only `awaiting_rewards` samples of the line have an entry in its set.
                pipe.multi()
                pipe.zrem(line.deadlines_key, sample_id)
                await pipe.execute()
                return "stale", 0
            policy = self._policy_of(line)
            state = (orjson.loads(raw_state) if raw_state
                     else await self._state_before_policy(pipe, key, created_at, policy))
            expiry = policy.expire(state, now)
            # Read while the hash is WATCHed, before MULTI: the references a drop must release.
            blocks = await pipe.hget(key, "prompt_blocks") if expiry.drop else None
            pipe.multi()
            for name in expiry.fallbacks:
                pipe.hincrby(line.stats_key, keys.stats_reward_fallback(name), 1)
            if expiry.drop:
                # Invariant 5: hash, index membership, deadline entry and counters leave together; the drop is
                # counted in the same EXEC, so racing sweepers never count it twice. Invariant P
                # (store/prompt_blocks.py): the sample's prompt-block references go in this EXEC too.
                pipe.delete(key)
                prompt_blocks.queue_release(pipe, prompt_blocks.release_counts([blocks]))
                pipe.zrem(line.index_key(SampleStatus.AWAITING_REWARDS), sample_id)
                pipe.zrem(line.deadlines_key, sample_id)
                line.queue_counters(
                    pipe, SampleStatus.AWAITING_REWARDS, source or "", policy_version or BASE_POLICY, -1
                )
                pipe.hincrby(line.stats_key, "reward_dropped", 1)
                await pipe.execute()
                return "dropped", len(expiry.fallbacks)
            new_status = policy.status(expiry.state)
            at = ids.now_iso()
            pipe.hset(key, mapping={"rewards": orjson.dumps(expiry.state), "updated_at": at})
            self._queue_after_change(
                pipe, line, sample_id, expiry.state, new_status, source, policy_version, created_at, at
            )
            await pipe.execute()
            return new_status, len(expiry.fallbacks)

        return await fence.transact(self._redis, body, key)

    # ------------------------------------------------------------------ reads

    async def waiting(self) -> int:
        """Samples of the default line waiting, plus one per other line with a deadline entry (its due-hint)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self._deadlines_key)
            pipe.zcard(keys.REWARD_DUE_LINES)
            counts = await pipe.execute()
        return sum(int(n) for n in counts)

    async def stats(self) -> dict[str, Any]:
        """The `rewards` part of the trajectory stats: drops, and per source arrivals, fallbacks and lateness
        percentiles over its last LATENCY_WINDOW arrivals (bounded reads, whatever the number of samples)."""
        names = list(self._policy.external)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._stats_key)
            pipe.zrange(self._deadlines_key, 0, 0, withscores=True)
            for name in names:
                pipe.lrange(keys.reward_latency(self._owner, name), 0, -1)
            raw_counters, first, *latencies = await pipe.execute()
        counters = {text(k) or "": int(v) for k, v in raw_counters.items()}
        sources = {}
        for name, raw in zip(names, latencies):
            late = sorted(float(v) for v in raw)
            sources[name] = {
                "arrived": counters.get(keys.stats_reward_arrived(name), 0),
                "fallback": counters.get(keys.stats_reward_fallback(name), 0),
                "late_p50_seconds": percentile(late, 0.50),
                "late_p95_seconds": percentile(late, 0.95),
            }
        return {
            "aggregation": self._policy.aggregation,
            "waiting": counters.get(keys.stats_status(SampleStatus.AWAITING_REWARDS), 0),
            "next_deadline_at": iso_at(float(first[0][1])) if first else None,
            "dropped": counters.get("reward_dropped", 0),
            "sources": sources,
        }


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list; None when it is empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]
