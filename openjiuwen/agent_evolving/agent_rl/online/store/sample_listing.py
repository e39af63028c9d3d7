"""The paged sample listing of one line (CONTRACT §2.7): status buckets in listing order, (score, sample id)
ascending within a bucket, summaries from index fields only (never `sample_json` or the packed arrays)."""

from __future__ import annotations

import base64
import math
from typing import Any

import orjson
from redis.asyncio import Redis

from ...common.ids import InvalidIdentifier
from ..errors import InvalidInput
from . import keys
from .codec import text
from .hash_reads import hmget_many
from .listing import cursor_fields, invalid_cursor
from .sample_documents import INSTANCE_EXCLUSION
from .sample_line import SampleLine
from .sample_status import ALL_SAMPLE_STATUSES, SampleStatus

# Index fields copied out of the document so that listings never decode `sample_json` or the packed arrays.
_SUMMARY_FIELDS = (
    "sample_id", "user_id", "session_id", "rl_task_id", "source", "policy_version", "created_at", "updated_at",
    "status", "instance", "sampling", "exclusion",
)
_ALL_BUCKETS = "*"


class SampleListing:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    async def list_page(self, line: SampleLine, status: str | None, limit: int, cursor: str | None) -> dict[str, Any]:
        """CONTRACT §2.7 listing of `line`: buckets in status order, (score, sample id) ascending within a bucket."""
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
            for member, score in await self._bucket_slice(line.index_key(bucket), after, want - len(entries)):
                entries.append((bucket, member, score))
            after = None
            if len(entries) >= want:
                break
        next_cursor = None
        if len(entries) > limit:
            entries = entries[:limit]
            bucket, member, score = entries[-1]
            next_cursor = _encode_cursor(status, bucket, score, member)
        return {"items": await self._summaries(line.model_id, [member for _, member, _ in entries]),
                "next_cursor": next_cursor}

    async def _bucket_slice(self, index: str, after: tuple[float, str] | None, count: int) -> list[tuple[str, float]]:
        """Up to `count` (member, score) of one index, strictly after `after` in (score, member) order.

        Redis orders equal scores by member bytes, which for our ASCII ids is Python's string order, so the only
        work is to find how many members of the cursor's equal-score block precede or equal the cursor id."""
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

    async def _summaries(self, model_id: str, sample_ids: list[str]) -> list[dict[str, Any]]:
        rows = await hmget_many(self._redis, [keys.traj(sample_id) for sample_id in sample_ids], _SUMMARY_FIELDS)
        items = []
        for sample_id, row in zip(sample_ids, rows):
            values = dict(zip(_SUMMARY_FIELDS, (text(v) for v in row)))
            if values["status"] is None:
                continue  # deleted between the index read and this one
            items.append(
                {
                    "trajectory_id": sample_id,
                    "sample_id": values["sample_id"] or sample_id,
                    "model_id": model_id,
                    "source": values["source"],
                    "status": values["status"],
                    "user_id": values["user_id"],
                    "session_id": values["session_id"] or None,
                    "task_id": values["rl_task_id"] or None,
                    "policy_version": values["policy_version"],
                    "sampling": orjson.loads(values["sampling"]) if values["sampling"] else None,
                    "exclusion": orjson.loads(values["exclusion"]) if values["exclusion"] else (
                        INSTANCE_EXCLUSION if values["status"] == SampleStatus.EXCLUDED else None),
                    "created_at": values["created_at"],
                    "updated_at": values["updated_at"],
                    "instance": values["instance"] or None,
                }
            )
        return items


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
