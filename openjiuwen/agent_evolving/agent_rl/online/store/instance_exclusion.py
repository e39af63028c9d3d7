"""An operator excludes what one vLLM instance served from training (issue 28 item 2, invariant 11)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ...common import ids
from ...common.lineage import DEFAULT_LINEAGE, is_lineage
from ...common.policy_names import BASE_POLICY
from . import keys
from .codec import text
from .hash_reads import hmget_many
from .sample_line import SampleLine
from .sample_status import SampleStatus
from .tx import transact

# Statuses an exclusion takes samples out of: published, not yet claimed by a Training Run.
_EXCLUDABLE = (SampleStatus.AWAITING_REWARDS, SampleStatus.PENDING)
_LINE_PAGE = 500  # registered lineages read at once when every line is visited
_EXCLUDE_CHUNK = 256  # samples moved per transaction by an exclusion


class InstanceExclusion:
    """Moves an excluded instance's unclaimed samples of every line of one model (`line`: the default line)."""

    def __init__(self, redis: Redis, line: SampleLine) -> None:
        self._redis = redis
        self._line = line

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
                matched = await self._served_by(line, instance, status)
                for start in range(0, len(matched), _EXCLUDE_CHUNK):
                    moved += await self._exclude(line, matched[start:start + _EXCLUDE_CHUNK])
            training += len(await self._served_by(line, instance, SampleStatus.TRAINING))
        excluded = sorted(text(m) or "" for m in await self._redis.smembers(keys.EXCLUDED_INSTANCES))
        return {"instance": instance, "excluded": moved, "training": training, "excluded_instances": excluded}

    async def _every_line(self) -> AsyncIterator[SampleLine]:
        """The default line, then every registered lineage's (docs/lineages.md), read from the registry a page at a
        time. An exclusion is a rare operator action, so reading every line once is its price; nothing periodic
        walks the registry like this."""
        yield self._line
        start = 0
        while True:
            page = [text(m) or "" for m in await self._redis.zrange(keys.LINEAGES, start, start + _LINE_PAGE - 1)]
            for lineage in page:
                if is_lineage(lineage) and lineage != DEFAULT_LINEAGE:
                    line = self._line.for_lineage(lineage)
                    if line is not self._line:
                        yield line
            if len(page) < _LINE_PAGE:
                return
            start += _LINE_PAGE

    async def _served_by(self, line: SampleLine, instance: str, status: str) -> list[str]:
        """Ids in `line`'s `status` index whose sample `instance` served (index field reads only)."""
        members = [text(m) or "" for m in await self._redis.zrange(line.index_key(status), 0, -1)]
        found: list[str] = []
        for start in range(0, len(members), 1000):
            chunk = members[start:start + 1000]
            rows = await hmget_many(self._redis, [keys.traj(m) for m in chunk], ("instance",))
            found += [m for m, (served,) in zip(chunk, rows) if text(served) == instance]
        return found

    async def _exclude(self, line: SampleLine, sample_ids: list[str]) -> int:
        hash_keys = {sample_id: keys.traj(sample_id) for sample_id in sample_ids}

        async def body(pipe: Pipeline) -> int:
            rows = await hmget_many(self._redis, hash_keys.values(), ("status", "policy_version"))
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
                line.queue_move(pipe, sample_id, old=status, new=SampleStatus.EXCLUDED, score=score,
                                policy_version=policy, at=at)
                if status == SampleStatus.AWAITING_REWARDS:
                    pipe.zrem(line.deadlines_key, sample_id)
            await pipe.execute()
            return len(moves)

        return await transact(self._redis, body, *hash_keys.values())
