"""Publication: a sample enters its line's store once, with its status, indexes, counters and aggregates in one EXEC
(the capture path's write; CONTRACT §5.2, invariants 4, 5, 11 and P)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common import constraints, ids
from ...common.constraints import CORRECT, EXCLUDE, POLICY_DEFAULTS
from ...common.lineage import DEFAULT_LINEAGE
from ...common.policy_names import BASE_POLICY
from . import keys, prompt_blocks
from .codec import PackedSample, text
from .policy_stats import queue_sample_contribution
from .sample_line import SampleLine
from .sample_metrics import SampleMetrics
from .sample_status import SampleStatus
from .tx import transact


class SamplePublisher:
    """Inserts samples, each into the line of its lineage (docs/lineages.md)."""

    def __init__(
        self,
        redis: Redis,
        line: SampleLine,
        *,
        metrics: SampleMetrics | None = None,
        constrained: Mapping[str, str] | None = None,
    ) -> None:
        self._redis = redis
        self._line = line
        self._metrics = metrics
        # The `constrained_samples` setting (common/constraints.py): a sample carrying a kind it excludes is
        # published `excluded`, with its `exclusion`.
        self._constrained: Mapping[str, str] = constrained if constrained is not None else POLICY_DEFAULTS

    async def insert_if_absent(self, samples: Sequence[PackedSample]) -> list[str]:
        """Insert every sample whose hash has no `status` yet, as `pending` (or, under a reward policy with
        external sources, `awaiting_rewards`; a sample of an evaluation Task as `evaluation`, whatever the policy:
        it never waits to become trainable; a sample served by an excluded instance, or carrying a constraint the
        `constrained_samples` setting excludes, as `excluded`); returns the inserted ids in input order.

        An existing sample is never re-inserted or reset (invariant 4): publication may be repeated safely."""
        by_lineage: dict[str, list[PackedSample]] = {}
        for sample in samples:
            by_lineage.setdefault(str(sample.meta.get("lineage") or DEFAULT_LINEAGE), []).append(sample)
        inserted: list[str] = []
        for lineage, group in by_lineage.items():  # one transaction per line: a line's keys change together
            inserted += await self._insert(self._line.for_lineage(lineage), group)
        return inserted

    async def _insert(self, line: SampleLine, samples: Sequence[PackedSample]) -> list[str]:
        """`insert_if_absent` for samples of `line` only."""
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
                self._queue_insert(pipe, line, by_id[sample_id], split[sample_id], excluded=excluded, now=now,
                                   now_epoch=now_epoch)
            pipe.sadd(keys.TRAJ_USERS, line.owner)
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
        self, pipe: Pipeline, line: SampleLine, sample: PackedSample, split: tuple[list[tuple[bytes, bytes]], bytes], *,
        excluded: set[str], now: str, now_epoch: float,
    ) -> None:
        """Queue, in `insert_if_absent`'s MULTI, one fresh sample of `line`: its hash, status index, counters, policy stats
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
        reward_policy = line.reward_policy
        if reward_policy is not None:
            # An evaluation or excluded sample keeps a reward state (external sources may still post to an
            # evaluation one) but never enters `awaiting_rewards` nor the deadline index.
            state = reward_policy.initial(meta.get("judge"), now_epoch)
            status = final or reward_policy.status(state)
            extra = {"rewards": orjson.dumps(state)}
            if status == SampleStatus.AWAITING_REWARDS:
                line.queue_deadline(pipe, sample_id, reward_policy.next_deadline(state))
        blocks, tail = split
        pipe.hset(
            keys.traj(sample_id),
            mapping={
                "sample_id": sample_id,
                "user_id": str(meta.get("user_id") or line.owner),
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
                **({"lineage": line.lineage} if line.lineage != DEFAULT_LINEAGE else {}),
            },
        )
        pipe.zadd(line.index_key(status), {sample_id: ids.parse_iso_epoch(created_at)})
        if status == SampleStatus.PENDING:
            line.queue_waiting(pipe, ids.parse_iso_epoch(created_at))
        line.queue_counters(pipe, status, source, policy_version, +1)
        queue_sample_contribution(pipe, policy_version, meta, sample.response_ids, +1)
