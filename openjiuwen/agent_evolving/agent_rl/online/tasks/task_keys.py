"""Every Redis key one Task may own, found from its own sets and turn pointers (no SCAN): what retention gives a TTL
and what a lineage's deletion removes (docs/lineages.md "Lifecycle")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from ..store import keys
from ..store.codec import text


@dataclass(frozen=True, slots=True)
class TaskKeys:
    keys: list[str]  # the record and every key hanging off it
    captures: list[str]  # its capture ids (a published capture's sample has the same id)


async def keys_of_tasks(redis: Redis, task_ids: Sequence[str]) -> list[TaskKeys]:
    """The keys of each Task, read in one round trip: captures and their staged samples, turns, reward, timeline."""
    async with redis.pipeline(transaction=False) as reads:
        for t in task_ids:
            reads.smembers(keys.captures(t))
            reads.smembers(keys.turns_closed(t))
            reads.mget(keys.turn_current(t), keys.turn_transition(t))
        rows = await reads.execute()
    out = []
    for i, t in enumerate(task_ids):
        raw_captures, raw_closed, (current, transition) = rows[3 * i:3 * i + 3]
        captures = sorted(text(c) or "" for c in raw_captures)
        turns = {text(u) or "" for u in raw_closed} | {text(u) or "" for u in (current, transition) if u is not None}
        owned = [
            keys.task(t), keys.captures(t), keys.open_captures(t), keys.committed_captures(t),
            keys.turn_current(t), keys.turn_transition(t), keys.turns_closed(t), keys.reward(t), keys.task_events(t),
        ]
        for c in captures:
            owned += [keys.capture(t, c), keys.staged(t, c)]
        for u in sorted(turns):
            owned += [keys.turn_captures(t, u), keys.turn_publish(t, u), keys.turn_publisher(t, u)]
        out.append(TaskKeys(owned, captures))
    return out


async def keys_of_task(redis: Redis, t: str) -> list[str]:
    """The keys of one Task (`keys_of_tasks`)."""
    return (await keys_of_tasks(redis, [t]))[0].keys
