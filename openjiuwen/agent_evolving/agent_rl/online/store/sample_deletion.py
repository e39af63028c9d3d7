"""Samples leaving the store: a failed publication rolled back, retention's expired samples, a deleted lineage's
(CONTRACT §5.5(c), docs/lineages.md "Lifecycle"). Each removal takes hash, index membership, a deadline entry and the
counters together (invariant 5) and the sample's prompt-block references (invariant P) in one EXEC."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common.policy_names import BASE_POLICY
from . import keys, prompt_blocks
from .codec import decode_meta, text
from .fence import UNFENCED, Fence
from .hash_reads import hmget_many
from .policy_stats import queue_sample_contribution
from .sample_line import SampleLine
from .sample_status import SampleStatus

# Statuses a failed publication may have left its samples in (`delete_pending` rolls them back).
_UNCLAIMED = (SampleStatus.PENDING, SampleStatus.AWAITING_REWARDS, SampleStatus.EVALUATION, SampleStatus.EXCLUDED)
# Statuses retention sweeps: samples no Training Run will ever read again.
_SWEPT = (SampleStatus.TRAINED, SampleStatus.FAILED, SampleStatus.EVALUATION, SampleStatus.EXCLUDED,
          SampleStatus.OUTDATED)


@dataclass(frozen=True, slots=True)
class StoredSample:
    """A sample as its deletion needs it (`SampleDeletion.queue_delete`)."""

    sample_id: str
    status: str
    source: str
    blocks: bytes | None  # its packed prompt-block digests
    policy_version: str


class SampleDeletion:
    """Deletes samples of the lines of one model (`line`: the default line; each sample's own line is found from it)."""

    def __init__(self, redis: Redis, line: SampleLine) -> None:
        self._redis = redis
        self._line = line

    async def delete_pending(self, sample_ids: Sequence[str], *, fence: Fence = UNFENCED) -> int:
        """Roll back samples inserted by a failed publication: those still `pending`, `awaiting_rewards` or
        `evaluation` are deleted; returns the count. `fence`: the leader's in startup recovery."""
        hash_keys = {sample_id: keys.traj(sample_id) for sample_id in dict.fromkeys(sample_ids)}
        if not hash_keys:
            return 0

        async def body(pipe: Pipeline) -> int:
            rows = await hmget_many(
                self._redis, hash_keys.values(),
                ("status", "source", "policy_version", "sample_json", "response_ids", "prompt_blocks", "lineage"),
            )
            doomed = [
                (sample_id, text(status) or "", text(source) or "", text(policy) or BASE_POLICY, sample_json,
                 response_ids, blocks, self._line.for_lineage(text(lineage)))
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
                    pipe.zrem(owner.deadlines_key, sample_id)
                owner.queue_counters(pipe, status, source, policy_version, -1)
                meta = decode_meta(sample_json)
                queue_sample_contribution(pipe, policy_version, meta, response_ids or b"", -1)
            await pipe.execute()
            return len(doomed)

        return await fence.transact(self._redis, body, *hash_keys.values())

    async def sweep_expired(
        self, line: SampleLine, *, retention_seconds: int, now: float, fence: Fence, limit: int = 1000
    ) -> int:
        """CONTRACT §5.5(c): delete `line`'s `trained`/`failed` samples whose index score is older than
        `now − retention`, at most `limit` per status, one EXEC per status, each through `fence` (the retention
        sweeper's, a leader duty). `pending` and `training` samples never expire; `evaluation` samples expire like
        trained ones (scored by creation: they were final when published). Their contribution to the per-version
        aggregates stays (store/policy_stats.py)."""
        cutoff = now - retention_seconds
        removed = 0
        for status in _SWEPT:
            index = line.index_key(status)
            members = await self._redis.zrange(index, "-inf", f"({cutoff!r}", byscore=True, offset=0, num=limit)
            sample_ids = [text(m) or "" for m in members]
            if sample_ids:
                removed += await self.delete_in_status(line, status, sample_ids, fence)
        return removed

    async def delete_in_status(self, line: SampleLine, status: str, sample_ids: list[str], fence: Fence) -> int:
        """Delete samples of `line`'s `status` index (retention's old samples, or any status when a lineage is
        deleted, docs/lineages.md "Lifecycle") in one EXEC through `fence`; a sample that moved meanwhile stays.
        Their contribution to the per-version aggregates stays, as `sweep_expired` says."""
        hash_keys = [keys.traj(sample_id) for sample_id in sample_ids]
        index = line.index_key(status)

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
                    pipe.hincrby(line.stats_key, keys.stats_status(status), -1)
                    if status == SampleStatus.AWAITING_REWARDS:
                        pipe.zrem(line.deadlines_key, sample_id)
                count += 1
            self.queue_delete(line, pipe, [row for row in rows.values() if row is not None and row.status == status])
            await pipe.execute()
            return count

        return await fence.transact(self._redis, body, index, *hash_keys)

    async def rows_to_delete(self, sample_ids: Sequence[str]) -> list[StoredSample | None]:
        """What `queue_delete` needs of each sample (None: no hash). Read inside the caller's transaction, which
        WATCHes the hashes."""
        rows = await hmget_many(self._redis, [keys.traj(s) for s in sample_ids],
                                ("status", "source", "prompt_blocks", "policy_version"))
        return [None if text(status) is None else StoredSample(sample_id, text(status) or "", text(source) or "",
                                                                blocks, text(policy) or BASE_POLICY)
                for sample_id, (status, source, blocks, policy) in zip(sample_ids, rows)]

    @staticmethod
    def queue_delete(line: SampleLine, pipe: Pipeline, samples: Sequence[StoredSample]) -> None:
        """Queue, in the caller's MULTI, the removal of samples of `line`: invariant 5 (hash, index membership,
        a deadline entry and the counters together) and invariant P (their prompt-block references)."""
        for sample in samples:
            pipe.delete(keys.traj(sample.sample_id))
            pipe.zrem(line.index_key(sample.status), sample.sample_id)
            if sample.status == SampleStatus.AWAITING_REWARDS:
                pipe.zrem(line.deadlines_key, sample.sample_id)
            line.queue_counters(pipe, sample.status, sample.source, sample.policy_version, -1)
        prompt_blocks.queue_release(pipe, prompt_blocks.release_counts(s.blocks for s in samples))
