"""The Redis trajectory store: one hash per sample, one sorted-set index per status, O(1) counters (CONTRACT §5.2).

A sample lives in `traj:{id}` (index fields, `sample_json`, the packed arrays; its prompt as shared
`prompt_block:{digest}` blocks named by `prompt_blocks` plus the tail in `prompt_ids`, see `prompt_blocks.py`), its
id in exactly one `traj_idx:{owner}:{status}` ZSET, and `traj_stats:{owner}` counts it under `status:<s>`,
`source:<src>` and, while pending, `pending_policy:<version>`. Every status move changes hash, indexes and counters in
one EXEC (invariant 5), so the stats route never scans. `queue_move` is the one place that spells such a move; the
training side reuses it.
"""

from __future__ import annotations

import base64
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common import constraints, ids
from ...common.constraints import CORRECT, EXCLUDE, POLICY_DEFAULTS
from ...common.lineage import DEFAULT_LINEAGE, is_lineage, line_of, split_line
from ...common.policy_names import BASE_POLICY
from ..errors import InvalidInput
from ...common.ids import InvalidIdentifier
from . import keys, prompt_blocks
from .codec import PackedSample, decode_meta, text
from .listing import cursor_fields, invalid_cursor
from .policy_stats import queue_contribution
from .reward_view import RewardRules, breakdown
from .sample_metrics import SampleMetrics
from .sample_status import ALL_SAMPLE_STATUSES, SAMPLE_STATUSES, SAMPLE_TRANSITIONS, SampleStatus
from .tx import transact
from .fence import UNFENCED, Fence

# Statuses a failed publication may have left its samples in (`delete_pending` rolls them back).
_UNCLAIMED = (SampleStatus.PENDING, SampleStatus.AWAITING_REWARDS, SampleStatus.EVALUATION, SampleStatus.EXCLUDED)
# Statuses retention sweeps: samples no Training Run will ever read again.
_SWEPT = (SampleStatus.TRAINED, SampleStatus.FAILED, SampleStatus.EVALUATION, SampleStatus.EXCLUDED,
          SampleStatus.OUTDATED)
# Statuses an exclusion takes samples out of: published, not yet claimed by a Training Run.
_EXCLUDABLE = (SampleStatus.AWAITING_REWARDS, SampleStatus.PENDING)
_LINE_PAGE = 500  # registered lineages read at once when every line is visited
_EXCLUDE_CHUNK = 256  # samples moved per transaction by an exclusion
_OUTDATED_CHUNK = 256  # pending samples read (and at most moved) per transaction by `retire_outdated`
# Index fields copied out of the document so that listings never decode `sample_json` or the packed arrays.
_SUMMARY_FIELDS = (
    "sample_id", "user_id", "session_id", "rl_task_id", "source", "policy_version", "created_at", "updated_at",
    "status", "instance", "sampling", "exclusion",
)
# The `exclusion` shown for an `excluded` sample stored without one: its instance was excluded (issue 28 item 2).
_INSTANCE_EXCLUSION = {"reason": "instance"}
_DOC_FIELDS = (
    "sample_json", "prompt_ids", "response_ids", "response_logprobs", "rewards", "prompt_blocks", "status",
)
_BLOCK_READ_ATTEMPTS = 3  # a block vanishes under a reader only when its sample was deleted meanwhile
_ALL_BUCKETS = "*"


def stale_pending(
    counters: Mapping[str, int], *, model_id: str, current_version: int, max_policy_lag: int | None
) -> int:
    """Pending samples whose policy lags `current_version` by more than `max_policy_lag` (none without a limit),
    counted from the per-version pending counters in O(number of versions)."""
    if max_policy_lag is None:
        return 0
    prefix = keys.STATS_PENDING_POLICY_PREFIX
    return sum(
        n for name, n in counters.items()
        if name.startswith(prefix) and n > 0
        and current_version - ids.policy_lag_version(name[len(prefix):], model_id) > max_policy_lag
    )


@dataclass(frozen=True, slots=True)
class StoredSample:
    """A sample as its deletion needs it (`TrajectoryStore.queue_delete`)."""

    sample_id: str
    status: str
    source: str
    blocks: bytes | None  # its packed prompt-block digests
    policy_version: str


class TrajectoryStore:
    """Samples of one owner in Redis: the service `model_id` (the default lineage's line), or, through `for_line`,
    the line `<model_id>:<lineage>` of another lineage (docs/lineages.md), whose samples have their own status
    indexes and counters (`traj_idx:{line}:…`, `traj_stats:{line}`), so a run of a line claims from its own index."""

    def __init__(
        self,
        redis: Redis,
        *,
        owner: str,
        model_id: str,
        max_policy_lag: int | None = None,
        reward_policy: RewardRules | None = None,
        metrics: SampleMetrics | None = None,
        constrained: Mapping[str, str] | None = None,
    ) -> None:
        self._redis = redis
        self._metrics = metrics
        # The `constrained_samples` setting (common/constraints.py): a sample carrying a kind it excludes is
        # published `excluded`, with its `exclusion`.
        self._constrained: Mapping[str, str] = constrained if constrained is not None else POLICY_DEFAULTS
        self._owner = owner
        self._model_id = model_id
        self._max_policy_lag = max_policy_lag
        # With a configured reward policy, publication starts each sample's reward state and may park it in
        # `awaiting_rewards` (docs/rewards.md); without one every published sample is `pending` at once.
        self._root_policy = reward_policy if reward_policy is not None and reward_policy.configured else None
        self._stats_key = keys.traj_stats(owner)  # validates the owner once
        self._deadlines_key = keys.reward_deadlines(owner)
        # This store's lineage: `default` for the service's own owner, else the lineage of the line it was made for.
        self.lineage = DEFAULT_LINEAGE if owner == model_id else split_line(owner)[1]
        # The line's own reward policy (`reward_policy.lineages.<name>`, else the top-level one).
        self._reward_policy = self._root_policy.for_lineage(self.lineage) if self._root_policy is not None else None
        self._lines: dict[str, TrajectoryStore] = {}

    def for_line(self, line: str) -> "TrajectoryStore":
        """The store of one line of this model (this store for its own line). Cheap: key names only."""
        if line == self._owner or (line == self._model_id and self.lineage == DEFAULT_LINEAGE):
            return self
        store = self._lines.get(line)
        if store is None:
            split_line(line)  # refuses a malformed line before it names keys
            store = TrajectoryStore(self._redis, owner=line, model_id=self._model_id,
                                    max_policy_lag=self._max_policy_lag, reward_policy=self._root_policy,
                                    metrics=self._metrics, constrained=self._constrained)
            self._lines[line] = store
        return store

    def for_lineage(self, lineage: str | None) -> "TrajectoryStore":
        return self.for_line(line_of(self._model_id, lineage or DEFAULT_LINEAGE))

    @property
    def owner(self) -> str:
        return self._owner

    @property
    def reward_policy(self) -> RewardRules | None:
        """The reward policy this line's samples follow (None without a configured policy)."""
        return self._reward_policy

    @property
    def deadlines_key(self) -> str:
        return self._deadlines_key

    @property
    def stats_key(self) -> str:
        return self._stats_key

    def queue_deadline(self, pipe: Pipeline, sample_id: str, deadline: float) -> None:
        """Queue, in a caller's MULTI, a sample's deadline entry; for a non-default line also lower the line's entry
        in `REWARD_DUE_LINES` to it, in the same EXEC, so that hint stays at or below the line's earliest deadline."""
        pipe.zadd(self._deadlines_key, {sample_id: deadline})
        if self.lineage != DEFAULT_LINEAGE:
            pipe.zadd(keys.REWARD_DUE_LINES, {self._owner: deadline}, lt=True)

    def index_key(self, status: str) -> str:
        return keys.traj_index(self._owner, status)

    def queue_waiting(self, pipe: Pipeline, created_at: float) -> None:
        """Queue, in the caller's MULTI that puts a sample of creation epoch `created_at` into this line's pending
        index, the lowering of the line's `TRAINING_WAITING` entry to it (non-default lines only): the line is due
        for the scheduler's judgement now, whatever it was judged before (the invariant in keys.py)."""
        if self.lineage != DEFAULT_LINEAGE:
            pipe.zadd(keys.TRAINING_WAITING, {self._owner: created_at}, lt=True)

    # ------------------------------------------------------------------ writes

    async def insert_if_absent(self, samples: Sequence[PackedSample]) -> list[str]:
        """Insert every sample whose hash has no `status` yet, as `pending` (or, under a reward policy with
        external sources, `awaiting_rewards`; a sample of an evaluation Task as `evaluation`, whatever the policy:
        it never waits to become trainable; a sample served by an excluded instance, or carrying a constraint the
        `constrained_samples` setting excludes, as `excluded`); returns the inserted ids in input order.

        An existing sample is never re-inserted or reset (invariant 4): publication may be repeated safely."""
        by_lineage: dict[str, list[PackedSample]] = {}
        for sample in samples:
            by_lineage.setdefault(str(sample.meta.get("lineage") or DEFAULT_LINEAGE), []).append(sample)
        if set(by_lineage) - {self.lineage}:
            # A sample belongs to its Task's lineage's line (docs/lineages.md): each line's samples go to its store.
            inserted = []
            for lineage, group in by_lineage.items():
                inserted += await self.for_lineage(lineage).insert_if_absent(group)
            return inserted
        by_id: dict[str, PackedSample] = {}
        for sample in samples:
            by_id.setdefault(str(sample.meta["sample_id"]), sample)  # the first of duplicate ids wins
        if not by_id:
            return []
        hash_keys = {sample_id: keys.traj(sample_id) for sample_id in by_id}
        # Hashing is pure CPU: done once, outside the retried transaction.
        split = {sample_id: prompt_blocks.split_prompt(sample.prompt_ids) for sample_id, sample in by_id.items()}
        now = ids.now_iso()

        async def body(pipe: Pipeline) -> list[str]:
            # Reads go through a plain pipeline on another connection: one round trip for all of them. They happen
            # after WATCH, so any later change to a hash still fails the EXEC below.
            async with self._redis.pipeline(transaction=False) as reads:
                for key in hash_keys.values():
                    reads.hexists(key, "status")
                reads.smembers(keys.EXCLUDED_INSTANCES)
                *present, raw_excluded = await reads.execute()
            excluded = {text(m) for m in raw_excluded}
            fresh = [sample_id for sample_id, exists in zip(by_id, present) if not exists]
            if not fresh:
                return []  # leaving the pipeline context UNWATCHes
            # Invariant 5 (CONTRACT §5.4): hash status, status index and counters change together; an
            # `awaiting_rewards` sample enters the deadline index in the same EXEC (docs/rewards.md invariants).
            # Invariant 11: a sample of an excluded instance is never trainable; the set is WATCHed, so an exclusion
            # that lands before this EXEC makes it run again.
            # Invariant P (prompt_blocks.py): the samples' prompt-block references are added in this EXEC too, so a
            # block exists iff some sample references it and `refs` counts those samples.
            pipe.multi()
            acquired: dict[bytes, tuple[bytes, int]] = {}
            for sample_id in fresh:
                for digest, block in split[sample_id][0]:
                    acquired[digest] = (block, acquired.get(digest, (block, 0))[1] + 1)
            prompt_blocks.queue_acquire(pipe, acquired)
            now_epoch = ids.parse_iso_epoch(now)
            for sample_id in fresh:
                self._queue_insert(pipe, by_id[sample_id], split[sample_id], excluded=excluded, now=now,
                                   now_epoch=now_epoch)
            pipe.sadd(keys.TRAJ_USERS, self._owner)
            await pipe.execute()
            return fresh

        fresh = await transact(self._redis, body, *hash_keys.values(), keys.EXCLUDED_INSTANCES)
        if self._metrics is not None:
            for sample_id in fresh:
                meta = by_id[sample_id].meta
                self._metrics.published(str(meta.get("source") or ""))
                excluded_kinds = set((meta.get("exclusion") or {}).get("kinds") or ())
                for kind in constraints.kinds_of(meta.get("sampling")):
                    self._metrics.constrained(kind, EXCLUDE if kind in excluded_kinds else CORRECT)
        return fresh

    def exclusion(self, meta: Mapping[str, Any]) -> dict[str, Any] | None:
        """Why the `constrained_samples` setting keeps a sample out of training, or None (evaluation samples are
        never trained anyway: they keep their own status)."""
        if meta.get("evaluation") is True:
            return None
        kinds = constraints.excluded_kinds(constraints.kinds_of(meta.get("sampling")), self._constrained)
        return {"reason": "constraint", "kinds": list(kinds)} if kinds else None

    def _queue_insert(
        self, pipe: Pipeline, sample: PackedSample, split: tuple[list[tuple[bytes, bytes]], bytes], *,
        excluded: set[str], now: str, now_epoch: float,
    ) -> None:
        """Queue, in `insert_if_absent`'s MULTI, one fresh sample: its hash, status index, counters, policy stats
        and (under a reward policy) its reward state and deadline. `split`: its prompt's shared blocks and tail."""
        meta = sample.meta
        sample_id = str(meta["sample_id"])
        source = str(meta.get("source") or "")
        policy_version = str(meta.get("policy_version") or BASE_POLICY)
        created_at = str(meta["created_at"])
        instance = meta.get("instance")
        exclusion = self.exclusion(meta)
        if exclusion is not None:
            meta["exclusion"] = exclusion  # in the document (written below) and in its own field for listings
        final = (SampleStatus.EVALUATION if meta.get("evaluation") is True
                 else SampleStatus.EXCLUDED if instance in excluded or exclusion is not None else None)
        status, extra = final or SampleStatus.PENDING, {}
        if self._reward_policy is not None:
            # An evaluation or excluded sample keeps a reward state (external sources may still post to an
            # evaluation one) but never enters `awaiting_rewards` nor the deadline index.
            state = self._reward_policy.initial(meta.get("judge"), now_epoch)
            status = final or self._reward_policy.status(state)
            extra = {"rewards": orjson.dumps(state)}
            if status == SampleStatus.AWAITING_REWARDS:
                self.queue_deadline(pipe, sample_id, self._reward_policy.next_deadline(state))
        blocks, tail = split
        pipe.hset(
            keys.traj(sample_id),
            mapping={
                "sample_id": sample_id,
                "user_id": str(meta.get("user_id") or self._owner),
                "session_id": str(meta.get("session_id") or ""),
                "rl_task_id": str(meta.get("rl_task_id") or ""),
                "source": source,
                "policy_version": policy_version,
                "created_at": created_at,
                "status": status,
                "updated_at": now,
                "run_id": "",
                "instance": instance if isinstance(instance, str) else "",
                "sample_json": sample.meta_blob(),
                # The ids after the last shared block; the blocks' digests only when there are blocks.
                "prompt_ids": tail,
                "response_ids": sample.response_ids,
                "response_logprobs": sample.response_logprobs,
                **extra,
                **({"prompt_blocks": prompt_blocks.pack_digests(d for d, _ in blocks)} if blocks else {}),
                **({"sampling": orjson.dumps(meta["sampling"])} if meta.get("sampling") else {}),
                **({"exclusion": orjson.dumps(exclusion)} if exclusion is not None else {}),
                # The line's owner of a non-default sample (its indexes and counters); absent for default.
                **({"lineage": self.lineage} if self.lineage != DEFAULT_LINEAGE else {}),
            },
        )
        pipe.zadd(self.index_key(status), {sample_id: ids.parse_iso_epoch(created_at)})
        if status == SampleStatus.PENDING:
            self.queue_waiting(pipe, ids.parse_iso_epoch(created_at))
        self.queue_counters(pipe, status, source, policy_version, +1)
        self._queue_policy_stats(pipe, policy_version, meta, sample.response_ids, +1)

    async def delete_pending(self, sample_ids: Sequence[str], *, fence: Fence = UNFENCED) -> int:
        """Roll back samples inserted by a failed publication: those still `pending`, `awaiting_rewards` or
        `evaluation` are deleted; returns the count. `fence`: the leader's in startup recovery."""
        hash_keys = {sample_id: keys.traj(sample_id) for sample_id in dict.fromkeys(sample_ids)}
        if not hash_keys:
            return 0

        async def body(pipe: Pipeline) -> int:
            rows = await self._hmget_many(
                hash_keys.values(),
                ("status", "source", "policy_version", "sample_json", "response_ids", "prompt_blocks", "lineage"),
            )
            doomed = [
                (sample_id, text(status) or "", text(source) or "", text(policy) or BASE_POLICY, sample_json,
                 response_ids, blocks, self.for_lineage(text(lineage)))
                for sample_id, (status, source, policy, sample_json, response_ids, blocks, lineage)
                in zip(hash_keys, rows) if text(status) in _UNCLAIMED
            ]
            if not doomed:
                return 0
            # Invariant 5: hash, status index membership (and the deadline index entry) and counters disappear
            # together, and the sample's contribution to its version's aggregates with them. Invariant P: its
            # prompt-block references go in the same EXEC.
            pipe.multi()
            prompt_blocks.queue_release(pipe, prompt_blocks.release_counts(row[6] for row in doomed))
            for sample_id, status, source, policy_version, sample_json, response_ids, _, owner in doomed:
                pipe.delete(hash_keys[sample_id])
                pipe.zrem(owner.index_key(status), sample_id)
                if status == SampleStatus.AWAITING_REWARDS:
                    pipe.zrem(owner._deadlines_key, sample_id)
                owner.queue_counters(pipe, status, source, policy_version, -1)
                meta = decode_meta(sample_json)
                self._queue_policy_stats(pipe, policy_version, meta, response_ids or b"", -1)
            await pipe.execute()
            return len(doomed)

        return await fence.transact(self._redis, body, *hash_keys.values())

    async def exclude_instance(self, instance: str) -> dict[str, Any]:
        """Exclude the samples `instance` served from training (an operator, issue 28 item 2): from now on its
        samples are published `excluded`, and those published and not yet claimed (`awaiting_rewards`, `pending`)
        move to `excluded` now. Samples a Training Run already claimed stay with it (`training`; they move to
        `excluded` if that run gives them back). Idempotent. Returns the counts and every excluded instance."""
        # First the set: a publication that has not executed yet WATCHes it and files the samples `excluded`, so
        # the scan below sees every sample published before.
        await self._redis.sadd(keys.EXCLUDED_INSTANCES, instance)
        moved = training = 0
        async for line in self._every_line():
            for status in _EXCLUDABLE:
                matched = await line._served_by(instance, status)
                for start in range(0, len(matched), _EXCLUDE_CHUNK):
                    moved += await line._exclude(matched[start:start + _EXCLUDE_CHUNK])
            training += len(await line._served_by(instance, SampleStatus.TRAINING))
        excluded = sorted(text(m) or "" for m in await self._redis.smembers(keys.EXCLUDED_INSTANCES))
        return {"instance": instance, "excluded": moved, "training": training, "excluded_instances": excluded}

    async def retire_outdated(
        self, *, current_version: int, max_policy_lag: int | None, fence: Fence, budget: int = 4096
    ) -> int:
        """Move this line's pending samples whose policy lags `current_version` (the line's active version) by more
        than `max_policy_lag` to `outdated`: no run would claim them, and left pending they would keep the line
        waiting (docs/training.md). The per-version pending counters say how many there are; the pending index is
        read from its head (old policies serve old samples) a chunk at a time until that many moved or `budget`
        members were read. Returns the number moved. `fence`: the leader's (its scheduler and its runs)."""
        if max_policy_lag is None:
            return 0
        counters = {text(k) or "": int(v) for k, v in (await self._redis.hgetall(self._stats_key)).items()}
        expected = stale_pending(counters, model_id=self._owner, current_version=current_version,
                                 max_policy_lag=max_policy_lag)
        index = self.index_key(SampleStatus.PENDING)
        moved = offset = read = 0
        while moved < expected and read < budget:
            members = [text(m) or "" for m in await self._redis.zrange(index, offset, offset + _OUTDATED_CHUNK - 1)]
            if not members:
                break
            read += len(members)
            rows = await self._hmget_many([keys.traj(m) for m in members], ("policy_version",))
            lagging = [m for m, (policy,) in zip(members, rows)
                       if self._lags(text(policy) or BASE_POLICY, current_version, max_policy_lag)]
            done = await self._retire(lagging, current_version, max_policy_lag, fence) if lagging else 0
            moved += done
            offset += len(members) - done  # the moved members left the ranks before `offset`
        if moved and self._metrics is not None:
            self._metrics.outdated(moved)
        return moved

    def _lags(self, policy_version: str, current_version: int, max_policy_lag: int) -> bool:
        return current_version - ids.policy_lag_version(policy_version, self._owner) > max_policy_lag

    async def _retire(self, sample_ids: list[str], current_version: int, max_policy_lag: int, fence: Fence) -> int:
        hash_keys = {sample_id: keys.traj(sample_id) for sample_id in sample_ids}

        async def body(pipe: Pipeline) -> int:
            rows = await self._hmget_many(hash_keys.values(), ("status", "policy_version"))
            moves = [(sample_id, text(policy) or BASE_POLICY) for sample_id, (status, policy) in zip(hash_keys, rows)
                     if text(status) == SampleStatus.PENDING
                     and self._lags(text(policy) or BASE_POLICY, current_version, max_policy_lag)]
            if not moves:
                return 0
            at = ids.now_iso()
            score = ids.parse_iso_epoch(at)
            # Invariant 5 through `queue_move` (hash, indexes, the `status:*` and `pending_policy:*` counters in one
            # EXEC). The hashes are WATCHed: a claim (which WATCHes the hashes it chose) landing first makes this
            # read again, so a sample is claimed or outdated, never both.
            pipe.multi()
            for sample_id, policy in moves:
                self.queue_move(pipe, sample_id, old=SampleStatus.PENDING, new=SampleStatus.OUTDATED, score=score,
                                policy_version=policy, at=at)
            await pipe.execute()
            return len(moves)

        return await fence.transact(self._redis, body, *hash_keys.values())

    async def _every_line(self) -> AsyncIterator["TrajectoryStore"]:
        """This store's line, then every registered lineage's (docs/lineages.md), read from the registry a page at a
        time. An exclusion is a rare operator action, so reading every line once is its price; nothing periodic
        walks the registry like this."""
        yield self
        start = 0
        while True:
            page = [text(m) or "" for m in await self._redis.zrange(keys.LINEAGES, start, start + _LINE_PAGE - 1)]
            for lineage in page:
                if is_lineage(lineage) and lineage != DEFAULT_LINEAGE:
                    line = self.for_lineage(lineage)
                    if line is not self:
                        yield line
            if len(page) < _LINE_PAGE:
                return
            start += _LINE_PAGE

    async def _served_by(self, instance: str, status: str) -> list[str]:
        """Ids in the `status` index whose sample `instance` served (index field reads only)."""
        members = [text(m) or "" for m in await self._redis.zrange(self.index_key(status), 0, -1)]
        found: list[str] = []
        for start in range(0, len(members), 1000):
            chunk = members[start:start + 1000]
            rows = await self._hmget_many([keys.traj(m) for m in chunk], ("instance",))
            found += [m for m, (served,) in zip(chunk, rows) if text(served) == instance]
        return found

    async def _exclude(self, sample_ids: list[str]) -> int:
        hash_keys = {sample_id: keys.traj(sample_id) for sample_id in sample_ids}

        async def body(pipe: Pipeline) -> int:
            rows = await self._hmget_many(hash_keys.values(), ("status", "policy_version"))
            at = ids.now_iso()
            score = ids.parse_iso_epoch(at)
            moves = [(sample_id, text(status) or "", text(policy) or BASE_POLICY)
                     for sample_id, (status, policy) in zip(hash_keys, rows) if text(status) in _EXCLUDABLE]
            if not moves:
                return 0
            # Invariant 11: an excluded instance's sample is never claimed. The hashes are WATCHed: a claim (which
            # WATCHes its chosen hashes too) or a reward arrival that lands first makes this run again on the new
            # status, so a sample is either claimed or excluded, never both. Invariant 5 through `queue_move`.
            pipe.multi()
            for sample_id, status, policy in moves:
                self.queue_move(pipe, sample_id, old=status, new=SampleStatus.EXCLUDED, score=score,
                                policy_version=policy, at=at)
                if status == SampleStatus.AWAITING_REWARDS:
                    pipe.zrem(self._deadlines_key, sample_id)
            await pipe.execute()
            return len(moves)

        return await transact(self._redis, body, *hash_keys.values())

    def queue_move(
        self,
        pipe: Pipeline,
        sample_id: str,
        *,
        old: str,
        new: str,
        score: float,
        policy_version: str,
        at: str,
        run_id: str | None = None,
    ) -> None:
        """Queue, inside a caller's MULTI, the writes of one status move (`pending → training`, `training →
        trained | failed`, `training → pending`, `awaiting_rewards → pending`): hash `status`/`updated_at` (and
        `run_id`), index membership and the counters, so the caller's EXEC keeps invariant 5. `score` is
        `created_at` epoch for `pending`, the transition time otherwise. The caller WATCHes the hash and checked that
        its status is `old`; a move the sample table (`sample_status.py`) forbids raises IllegalTransition."""
        SAMPLE_TRANSITIONS.check(old, new)
        mapping: dict[str, str] = {"status": new, "updated_at": at}
        if run_id is not None:
            mapping["run_id"] = run_id
        pipe.hset(keys.traj(sample_id), mapping=mapping)
        pipe.zrem(self.index_key(old), sample_id)
        pipe.zadd(self.index_key(new), {sample_id: score})
        pipe.hincrby(self._stats_key, keys.stats_status(old), -1)
        pipe.hincrby(self._stats_key, keys.stats_status(new), +1)
        if old == SampleStatus.PENDING:
            pipe.hincrby(self._stats_key, keys.stats_pending_policy(policy_version), -1)
        if new == SampleStatus.PENDING:
            pipe.hincrby(self._stats_key, keys.stats_pending_policy(policy_version), +1)
            self.queue_waiting(pipe, score)  # `score` is the sample's creation epoch here
        # `source:<src>` counts samples of every status, so a move leaves it alone.

    @staticmethod
    def _queue_policy_stats(pipe: Pipeline, policy_version: str, meta: dict[str, Any], response_ids: bytes,
                            sign: int) -> None:
        if not ids.is_token_id(policy_version):
            return  # not a name a key may carry; such a version is simply not reported
        queue_contribution(pipe, keys.policy_stats(policy_version), meta, len(response_ids) // 4, sign)
        if sign > 0:
            pipe.sadd(keys.POLICY_VERSIONS, policy_version)

    def queue_counters(self, pipe: Pipeline, status: str, source: str, policy_version: str, delta: int) -> None:
        """Queue the counter changes of a sample of `status` entering (+1) or leaving (-1) the store."""
        pipe.hincrby(self._stats_key, keys.stats_status(status), delta)
        pipe.hincrby(self._stats_key, keys.stats_source(source), delta)
        if status == SampleStatus.PENDING:
            pipe.hincrby(self._stats_key, keys.stats_pending_policy(policy_version), delta)

    async def sweep_expired(self, *, retention_seconds: int, now: float, fence: Fence, limit: int = 1000) -> int:
        """CONTRACT §5.5(c): delete `trained`/`failed` samples whose index score is older than `now − retention`,
        at most `limit` per status, one EXEC per status, each through `fence` (the retention sweeper's, a leader
        duty). `pending` and `training` samples never expire; `evaluation` samples expire like trained ones (scored
        by creation: they were final when published). Their contribution to the per-version aggregates stays
        (store/policy_stats.py)."""
        cutoff = now - retention_seconds
        removed = 0
        for status in _SWEPT:
            index = self.index_key(status)
            members = await self._redis.zrange(index, "-inf", f"({cutoff!r}", byscore=True, offset=0, num=limit)
            sample_ids = [text(m) or "" for m in members]
            if sample_ids:
                removed += await self.delete_in_status(status, sample_ids, fence)
        return removed

    async def delete_in_status(self, status: str, sample_ids: list[str], fence: Fence) -> int:
        """Delete samples of this line's `status` index (retention's old samples, or any status when a lineage is
        deleted, docs/lineages.md "Lifecycle") in one EXEC through `fence`; a sample that moved meanwhile stays.
        Their contribution to the per-version aggregates stays, as `sweep_expired` says."""
        hash_keys = [keys.traj(sample_id) for sample_id in sample_ids]
        index = self.index_key(status)

        async def body(pipe: Pipeline) -> int:
            rows = dict(zip(sample_ids, await self.rows_to_delete(sample_ids)))
            pipe.multi()
            count = 0
            for sample_id in sample_ids:
                row = rows[sample_id]
                if row is not None and row.status != status:
                    continue  # moved meanwhile (e.g. another sweeper): not ours to delete
                if row is None:
                    # A member without a hash (never expected) still leaves its index, and its status counter
                    # follows it (invariant 5).
                    pipe.zrem(index, sample_id)
                    pipe.hincrby(self._stats_key, keys.stats_status(status), -1)
                    if status == SampleStatus.AWAITING_REWARDS:
                        pipe.zrem(self._deadlines_key, sample_id)
                count += 1
            self.queue_delete(pipe, [row for row in rows.values() if row is not None and row.status == status])
            await pipe.execute()
            return count

        return await fence.transact(self._redis, body, index, *hash_keys)

    async def rows_to_delete(self, sample_ids: Sequence[str]) -> list["StoredSample | None"]:
        """What `queue_delete` needs of each sample (None: no hash). Read inside the caller's transaction, which
        WATCHes the hashes."""
        rows = await self._hmget_many([keys.traj(s) for s in sample_ids],
                                      ("status", "source", "prompt_blocks", "policy_version"))
        return [None if text(status) is None else StoredSample(sample_id, text(status) or "", text(source) or "",
                                                                blocks, text(policy) or BASE_POLICY)
                for sample_id, (status, source, blocks, policy) in zip(sample_ids, rows)]

    def queue_delete(self, pipe: Pipeline, samples: Sequence["StoredSample"]) -> None:
        """Queue, in the caller's MULTI, the removal of samples of this line: invariant 5 (hash, index membership,
        a deadline entry and the counters together) and invariant P (their prompt-block references)."""
        for sample in samples:
            pipe.delete(keys.traj(sample.sample_id))
            pipe.zrem(self.index_key(sample.status), sample.sample_id)
            if sample.status == SampleStatus.AWAITING_REWARDS:
                pipe.zrem(self._deadlines_key, sample.sample_id)
            self.queue_counters(pipe, sample.status, sample.source, sample.policy_version, -1)
        prompt_blocks.queue_release(pipe, prompt_blocks.release_counts(s.blocks for s in samples))

    # ------------------------------------------------------------------ reads

    async def stats(self) -> dict[str, Any]:
        """CONTRACT §2.7 counters: one HGETALL and one GET, whatever the number of samples."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._stats_key)
            pipe.get(keys.POLICY_OBSERVED)
            raw_counters, raw_observed = await pipe.execute()
        counters = {text(k) or "": max(0, int(v)) for k, v in raw_counters.items()}
        # `awaiting_rewards` is shown under a reward policy, or while samples still wait from one (else the shape
        # stays that of CONTRACT §2.7).
        # `evaluation` and `excluded` likewise appear once such samples are stored, so `total` counts them too.
        waiting = counters.get(keys.stats_status(SampleStatus.AWAITING_REWARDS), 0) > 0
        shown = [*((SampleStatus.AWAITING_REWARDS,) if self._reward_policy is not None or waiting else ()),
                 *SAMPLE_STATUSES]
        for optional in (SampleStatus.EVALUATION, SampleStatus.EXCLUDED, SampleStatus.OUTDATED):
            if counters.get(keys.stats_status(optional), 0) > 0:
                shown.append(optional)
        by_status = {status.value: counters.get(keys.stats_status(status), 0) for status in shown}
        by_source = {
            name[len("source:"):]: n for name, n in sorted(counters.items()) if name.startswith("source:") and n > 0
        }
        return {
            "total": sum(by_status.values()),
            "by_status": by_status,
            "by_source": by_source,
            "stale": self._stale(counters, raw_observed),
            "expired_unrewarded": counters.get("expired_unrewarded", 0),
            "updated_at": ids.now_iso(),
        }

    def _stale(self, counters: dict[str, int], raw_observed: bytes | None) -> int:
        if self._max_policy_lag is None or raw_observed is None:
            return 0
        try:
            observed = orjson.loads(raw_observed)
        except orjson.JSONDecodeError:
            return 0
        name = observed.get("lora_name") if isinstance(observed, dict) else None
        if not isinstance(name, str):
            return 0
        return stale_pending(
            counters, model_id=self._model_id, current_version=ids.policy_lag_version(name, self._model_id),
            max_policy_lag=self._max_policy_lag,
        )

    async def get_documents(self, sample_ids: Sequence[str]) -> list[dict[str, Any]]:
        """Logical documents (§4.5, arrays unpacked) of the samples that exist, in input order."""
        rows = await self._doc_rows([keys.traj(sample_id) for sample_id in sample_ids])
        return [self._document(row) for row in rows if row[-1] is not None]

    async def _doc_rows(self, hash_keys: Sequence[str]) -> list[list[bytes | None]]:
        """`_DOC_FIELDS` of each hash with `prompt_ids` holding the whole prompt again (shared blocks + tail).

        Invariant P guarantees the blocks of a sample that exists; a block missing here means its sample was
        deleted between the two reads, so that sample is read again (and is then gone, or complete)."""
        rows = await self._hmget_many(hash_keys, _DOC_FIELDS)
        todo = list(range(len(rows)))
        for attempt in range(_BLOCK_READ_ATTEMPTS):
            wanted = {i: prompt_blocks.unpack_digests(rows[i][5]) for i in todo if rows[i][-1] is not None}
            found = await prompt_blocks.read_blocks(self._redis, (d for ds in wanted.values() for d in ds))
            todo = []
            for i, digests in wanted.items():
                parts = [found[d] for d in digests]
                if any(part is None for part in parts):
                    todo.append(i)
                    continue
                rows[i] = [rows[i][0], b"".join([*(p or b"" for p in parts), rows[i][1] or b""]), *rows[i][2:]]
            if not todo:
                return rows
            if attempt + 1 < _BLOCK_READ_ATTEMPTS:
                for i, row in zip(todo, await self._hmget_many([hash_keys[i] for i in todo], _DOC_FIELDS)):
                    rows[i] = row
        raise RuntimeError(f"prompt blocks of {len(todo)} sample(s) stay missing (invariant P broken)")

    async def detail(self, sample_id: str) -> dict[str, Any] | None:
        """The full view of §4.5 (what the detail route returns), or None when the id is unknown or malformed."""
        try:
            key = keys.traj(sample_id)
        except InvalidIdentifier:
            return None
        row = (await self._doc_rows([key]))[0]
        status = text(row[-1])
        if status is None:
            return None
        # The breakdown follows the policy of the sample's own lineage (`reward_policy.lineages`).
        doc = self.for_lineage(text(await self._redis.hget(key, "lineage")))._document(row)
        trajectory = doc["trajectory"]
        prompt, response_ids = trajectory["prompt_ids"], trajectory["response_ids"]
        logprobs = trajectory["response_logprobs"]
        response_mask = trajectory.get("response_mask") or [1] * len(response_ids)
        trajectory["input_ids"] = prompt + response_ids
        trajectory["attention_mask"] = [1] * (len(prompt) + len(response_ids))
        trajectory["response_mask"] = [0] * len(prompt) + list(response_mask)
        trajectory["prompt_text"] = ""
        response = dict(doc.get("response") or {})
        response["prompt_token_ids"] = prompt
        choices = [dict(c) if isinstance(c, dict) else c for c in response.get("choices") or [{}]]
        if isinstance(choices[0], dict):
            choices[0]["token_ids"] = response_ids
            choices[0]["logprobs"] = {"content": [{"logprob": x} for x in logprobs]}
        response["choices"] = choices
        doc["response"] = response
        doc["trajectory_id"] = doc.get("trajectory_id") or sample_id
        doc.setdefault("instance", None)  # the serving instance, when the gateway said (ext)
        if status == SampleStatus.EXCLUDED:
            doc.setdefault("exclusion", _INSTANCE_EXCLUSION)  # a constraint's exclusion is in the document itself
        doc["status"] = status
        doc["_store_status"] = status
        return doc

    async def list_page(self, status: str | None, limit: int, cursor: str | None) -> dict[str, Any]:
        """CONTRACT §2.7 listing: buckets in status order, (score, sample id) ascending within a bucket."""
        if status is not None and status not in ALL_SAMPLE_STATUSES:
            raise InvalidInput("invalid_request", f"status must be one of {', '.join(ALL_SAMPLE_STATUSES)}")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise InvalidInput("invalid_request", "limit must be an integer between 1 and 1000")
        buckets = (status,) if status is not None else ALL_SAMPLE_STATUSES
        start, after = 0, None
        if cursor is not None:
            bucket, score, member = _decode_cursor(cursor, status)
            start, after = buckets.index(bucket), (score, member)
        want = limit + 1  # one more than the page tells whether a next page exists
        entries: list[tuple[str, str, float]] = []
        for bucket in buckets[start:]:
            for member, score in await self._bucket_slice(bucket, after, want - len(entries)):
                entries.append((bucket, member, score))
            after = None
            if len(entries) >= want:
                break
        next_cursor = None
        if len(entries) > limit:
            entries = entries[:limit]
            bucket, member, score = entries[-1]
            next_cursor = _encode_cursor(status, bucket, score, member)
        return {"items": await self._summaries([member for _, member, _ in entries]), "next_cursor": next_cursor}

    async def _bucket_slice(self, status: str, after: tuple[float, str] | None, count: int) -> list[tuple[str, float]]:
        """Up to `count` (member, score) of one index, strictly after `after` in (score, member) order.

        Redis orders equal scores by member bytes, which for our ASCII ids is Python's string order, so the only
        work is to find how many members of the cursor's equal-score block precede or equal the cursor id."""
        index = self.index_key(status)
        if after is None:
            raw = await self._redis.zrange(index, 0, count - 1, withscores=True)
        else:
            score, member = after
            skip = await self._block_offset(index, score, member)
            raw = await self._redis.zrange(
                index, repr(score), "+inf", byscore=True, offset=skip, num=count, withscores=True
            )
        return [(text(m) or "", s) for m, s in raw]

    async def _block_offset(self, index: str, score: float, member: str) -> int:
        """Number of members with exactly `score` that sort at or before `member`."""
        async with self._redis.pipeline(transaction=True) as pipe:  # one consistent view of the three reads
            pipe.zscore(index, member)
            pipe.zrank(index, member)
            pipe.zcount(index, "-inf", f"({score!r}")
            own_score, rank, below = await pipe.execute()
        if own_score is not None and own_score == score and rank is not None:
            return rank - below + 1
        # The cursor's sample left this index (trained, swept, …): binary-search its place in the block by rank.
        lo, hi = 0, await self._redis.zcount(index, repr(score), repr(score))
        while lo < hi:
            mid = (lo + hi) // 2
            found = await self._redis.zrange(index, repr(score), repr(score), byscore=True, offset=mid, num=1)
            if not found:  # the block shrank meanwhile
                hi = mid
            elif (text(found[0]) or "") > member:
                hi = mid
            else:
                lo = mid + 1
        return lo

    async def _summaries(self, sample_ids: list[str]) -> list[dict[str, Any]]:
        rows = await self._hmget_many([keys.traj(sample_id) for sample_id in sample_ids], _SUMMARY_FIELDS)
        items = []
        for sample_id, row in zip(sample_ids, rows):
            values = dict(zip(_SUMMARY_FIELDS, (text(v) for v in row)))
            if values["status"] is None:
                continue  # deleted between the index read and this one
            items.append(
                {
                    "trajectory_id": sample_id,
                    "sample_id": values["sample_id"] or sample_id,
                    "model_id": self._model_id,
                    "source": values["source"],
                    "status": values["status"],
                    "user_id": values["user_id"],
                    "session_id": values["session_id"] or None,
                    "task_id": values["rl_task_id"] or None,
                    "policy_version": values["policy_version"],
                    "sampling": orjson.loads(values["sampling"]) if values["sampling"] else None,
                    "exclusion": orjson.loads(values["exclusion"]) if values["exclusion"] else (
                        _INSTANCE_EXCLUSION if values["status"] == SampleStatus.EXCLUDED else None),
                    "created_at": values["created_at"],
                    "updated_at": values["updated_at"],
                    "instance": values["instance"] or None,
                }
            )
        return items

    async def _hmget_many(self, hash_keys: Any, fields: Sequence[str]) -> list[list[bytes | None]]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in hash_keys:
                pipe.hmget(key, fields)
            return await pipe.execute()

    def _document(self, row: list[bytes | None]) -> dict[str, Any]:
        """The logical document; under a reward policy `judge.score` is the aggregated score and `rewards` the
        per-source breakdown (the trainer reads `judge.score`)."""
        doc = self._packed(row).to_document()
        raw_rewards = row[4]
        if raw_rewards:
            state = orjson.loads(raw_rewards)
            policy = self._reward_policy
            # Without a policy (it was removed from the config) the recorded breakdown is still shown.
            doc["rewards"] = policy.view(state) if policy is not None else breakdown(state, "weighted_mean")
            if state.get("score") is not None and isinstance(doc.get("judge"), dict):
                doc["judge"] = {**doc["judge"], "score": state["score"]}
        return doc

    @staticmethod
    def _packed(row: list[bytes | None]) -> PackedSample:
        """From a `_doc_rows` row (its `prompt_ids` already the whole prompt)."""
        sample_json, prompt, response, logprobs = row[0], row[1], row[2], row[3]
        return PackedSample(decode_meta(sample_json), prompt or b"", response or b"", logprobs or b"")


def _encode_cursor(status: str | None, bucket: str, score: float, member: str) -> str:
    raw = orjson.dumps([status or _ALL_BUCKETS, bucket, score, member])
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _decode_cursor(cursor: str, status: str | None) -> tuple[str, float, str]:
    """(bucket, score, sample id) of a cursor made by `_encode_cursor` for the same `status` filter."""
    invalid = invalid_cursor()
    scope, bucket, score, member = cursor_fields(cursor, 4)
    if scope != (status or _ALL_BUCKETS) or bucket not in ALL_SAMPLE_STATUSES:
        raise invalid
    if status is not None and bucket != status:
        raise invalid
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise invalid
    try:
        keys.traj(member)
    except InvalidIdentifier:
        raise invalid from None
    return bucket, float(score), member
