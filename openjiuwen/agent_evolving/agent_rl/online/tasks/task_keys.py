"""Every Redis key one Task may own, found from its own sets and turn pointers (no SCAN): what retention gives a TTL
and what a lineage's deletion removes (docs/lineages.md "Lifecycle")."""

from __future__ import annotations

from redis.asyncio import Redis

from ..store import keys
from ..store.codec import text


async def keys_of_task(redis: Redis, t: str) -> list[str]:
    """The record and every key hanging off it: captures and their staged samples, turns, reward, timeline."""
    async with redis.pipeline(transaction=False) as reads:
        reads.smembers(keys.captures(t))
        reads.smembers(keys.turns_closed(t))
        reads.mget(keys.turn_current(t), keys.turn_transition(t))
        raw_captures, raw_closed, (current, transition) = await reads.execute()
    captures = sorted(text(c) or "" for c in raw_captures)
    turns = {text(u) or "" for u in raw_closed} | {text(u) or "" for u in (current, transition) if u is not None}
    out = [
        keys.task(t), keys.captures(t), keys.open_captures(t), keys.committed_captures(t),
        keys.turn_current(t), keys.turn_transition(t), keys.turns_closed(t), keys.reward(t), keys.task_events(t),
    ]
    for c in captures:
        out += [keys.capture(t, c), keys.staged(t, c)]
    for u in sorted(turns):
        out += [keys.turn_captures(t, u), keys.turn_publish(t, u), keys.turn_publisher(t, u)]
    return out
