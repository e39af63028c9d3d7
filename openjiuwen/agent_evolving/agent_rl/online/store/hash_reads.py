"""Fields of many sample hashes in one round trip (a plain pipeline: no transaction, a caller's WATCH still holds)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from redis.asyncio import Redis


async def hmget_many(redis: Redis, hash_keys: Iterable[str], fields: Sequence[str]) -> list[list[bytes | None]]:
    async with redis.pipeline(transaction=False) as pipe:
        for key in hash_keys:
            pipe.hmget(key, fields)
        return await pipe.execute()
