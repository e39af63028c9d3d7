"""Pending samples whose policy lags too far behind their line's active version become `outdated` (docs/training.md):
no run would claim them, and left pending they would keep the line waiting."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common import ids
from ...common.policy_names import BASE_POLICY
from . import keys
from .codec import text
from .fence import Fence
from .hash_reads import hmget_many
from .sample_line import SampleLine
from .sample_metrics import SampleMetrics
from .sample_stats import stale_pending
from .sample_status import SampleStatus

_OUTDATED_CHUNK = 256  # pending samples read (and at most moved) per transaction by `retire_outdated`


class OutdatedSamples:
    def __init__(self, redis: Redis, *, metrics: SampleMetrics | None = None) -> None:
        self._redis = redis
        self._metrics = metrics

    async def retire_outdated(
        self, line: SampleLine, *, current_version: int, max_policy_lag: int | None, fence: Fence, budget: int = 4096
    ) -> int:
        """Move `line`'s pending samples whose policy lags `current_version` (the line's active version) by more
        than `max_policy_lag` to `outdated`. The per-version pending counters say how many there are; the pending
        index is read from its head (old policies serve old samples) a chunk at a time until that many moved or
        `budget` members were read. Returns the number moved. `fence`: the leader's (its scheduler and its runs)."""
        if max_policy_lag is None:
            return 0
        counters = {text(k) or "": int(v) for k, v in (await self._redis.hgetall(line.stats_key)).items()}
        expected = stale_pending(counters, model_id=line.owner, current_version=current_version,
                                 max_policy_lag=max_policy_lag)
        index = line.index_key(SampleStatus.PENDING)
        moved = offset = read = 0
        while moved < expected and read < budget:
            members = [text(m) or "" for m in await self._redis.zrange(index, offset, offset + _OUTDATED_CHUNK - 1)]
            if not members:
                break
            read += len(members)
            rows = await hmget_many(self._redis, [keys.traj(m) for m in members], ("policy_version",))
            lagging = [m for m, (policy,) in zip(members, rows)
                       if _lags(line, text(policy) or BASE_POLICY, current_version, max_policy_lag)]
            done = await self._retire(line, lagging, current_version, max_policy_lag, fence) if lagging else 0
            moved += done
            offset += len(members) - done  # the moved members left the ranks before `offset`
        if moved and self._metrics is not None:
            self._metrics.outdated(moved)
        return moved

    async def _retire(
        self, line: SampleLine, sample_ids: list[str], current_version: int, max_policy_lag: int, fence: Fence
    ) -> int:
        hash_keys = {sample_id: keys.traj(sample_id) for sample_id in sample_ids}

        async def body(pipe: Pipeline) -> int:
            rows = await hmget_many(self._redis, hash_keys.values(), ("status", "policy_version"))
            moves = [(sample_id, text(policy) or BASE_POLICY) for sample_id, (status, policy) in zip(hash_keys, rows)
                     if text(status) == SampleStatus.PENDING
                     and _lags(line, text(policy) or BASE_POLICY, current_version, max_policy_lag)]
            if not moves:
                return 0
            at = ids.now_iso()
            score = ids.parse_iso_epoch(at)
            # Invariant 5 through `queue_move` (hash, indexes, the `status:*` and `pending_policy:*` counters in one
            # EXEC). The hashes are WATCHed: a claim (which WATCHes the hashes it chose) landing first makes this
            # read again, so a sample is claimed or outdated, never both.
            pipe.multi()
            for sample_id, policy in moves:
                line.queue_move(pipe, sample_id, old=SampleStatus.PENDING, new=SampleStatus.OUTDATED, score=score,
                                policy_version=policy, at=at)
            await pipe.execute()
            return len(moves)

        return await fence.transact(self._redis, body, *hash_keys.values())


def _lags(line: SampleLine, policy_version: str, current_version: int, max_policy_lag: int) -> bool:
    return current_version - ids.policy_lag_version(policy_version, line.owner) > max_policy_lag
