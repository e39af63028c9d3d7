"""Newest-first paging over a creation-time ZSET (Task and Training Run listings).

Order is (score, id) descending; the opaque cursor encodes (scope, score, id) of the last item of a page and the next
page starts strictly after it, so pages never repeat or skip an entry that stays in the index.
"""

from __future__ import annotations

import base64
import binascii
import math

import orjson
from redis.asyncio import Redis

from ..errors import InvalidInput
from .codec import text

_MAX_CURSOR_CHARS = 1024  # a sample id may be 300 characters


def encode_cursor(scope: str, score: float, member: str) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([scope, score, member])).rstrip(b"=").decode()


def invalid_cursor() -> InvalidInput:
    return InvalidInput("invalid_request", "invalid cursor")


def cursor_fields(cursor: str, count: int) -> list:
    """The `count` JSON fields of an opaque paging cursor (base64url of a JSON list); 400 for anything else."""
    if not cursor or len(cursor) > _MAX_CURSOR_CHARS or not cursor.isascii():
        raise invalid_cursor()
    try:
        value = orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError):
        raise invalid_cursor() from None
    if not isinstance(value, list) or len(value) != count:
        raise invalid_cursor()
    return value


def decode_cursor(cursor: str, scope: str) -> tuple[float, str]:
    """(score, id) of a cursor made by `encode_cursor` for the same `scope` (e.g. the status filter)."""
    invalid = invalid_cursor()
    got_scope, score, member = cursor_fields(cursor, 3)
    if got_scope != scope or not isinstance(member, str) or not member or len(member) > 300:
        raise invalid
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise invalid
    return float(score), member


async def newest_first(
    redis: Redis, index: str, *, limit: int, cursor: str | None, scope: str
) -> tuple[list[str], str | None]:
    """Up to `limit` ids of `index`, newest first, and the cursor of the next page (None on the last page)."""
    if cursor is None:
        raw = await redis.zrange(index, 0, limit, desc=True, withscores=True)
    else:
        score, member = decode_cursor(cursor, scope)
        # Members sharing the cursor's score come in descending id order; skip those at or before the cursor id.
        block = [text(m) or "" for m in await redis.zrange(index, repr(score), repr(score), byscore=True)]
        skip = sum(1 for m in block if m >= member)
        raw = await redis.zrange(
            index, repr(score), "-inf", desc=True, byscore=True, offset=skip, num=limit + 1, withscores=True
        )
    entries = [(text(m) or "", s) for m, s in raw]
    next_cursor = None
    if len(entries) > limit:
        entries = entries[:limit]
        last_id, last_score = entries[-1]
        next_cursor = encode_cursor(scope, last_score, last_id)
    return [m for m, _ in entries], next_cursor
