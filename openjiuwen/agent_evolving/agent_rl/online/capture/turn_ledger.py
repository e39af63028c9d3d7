"""Turn publication in delayed-feedback mode (CONTRACT §4.3): a turn's claim, its publication or failure, and the
move of the current turn, each one optimistic transaction keeping invariant 7 of CONTRACT §5.4 (one publisher per
turn; the current turn moves forward only past a published one). Raises domain errors, never HTTP statuses."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from .. import events
from ..errors import Conflict
from ..store import keys
from ..store.codec import text
from ..store.fence import UNFENCED, Fence
from ..store.tx import transact
from ..tasks.signals import TaskSignals
from ..tasks.task_records import TURN_PUBLICATION_TRANSITIONS, TurnPublication, read_task


class TurnLedger:
    def __init__(self, redis: Redis, *, signals: TaskSignals) -> None:
        self._redis = redis
        self.signals = signals  # the registry's: a publication step wakes what waits on the Task

    async def turn_state(self, rl_task_id: str) -> tuple[str | None, str | None]:
        """(current turn, transition turn)."""
        current, transition = await self._redis.mget(
            keys.turn_current(rl_task_id), keys.turn_transition(rl_task_id)
        )
        return text(current), text(transition)

    async def claim_publish(self, rl_task_id: str, turn_id: str, *, owner: str = "") -> TurnPublication:
        """Claim the publication of a turn for the worker process `owner`. Returns CLAIMED when this caller must
        publish, OPEN when captures are still open (wait and retry), or the existing state (PUBLISHING, PUBLISHED,
        FAILED).

        Invariant 7: only one caller publishes a turn; the claim is taken only while no capture is open, and it
        names its holder in the same EXEC (a claim of a dead holder is taken over with `take_over_publish`)."""
        t = rl_task_id
        task_key, open_key, publish_key = keys.task(t), keys.open_captures(t), keys.turn_publish(t, turn_id)

        async def body(pipe: Pipeline) -> TurnPublication:
            task = await read_task(pipe, task_key)
            state = text(await pipe.get(publish_key))
            if state is not None:
                return TurnPublication(state)
            if not task.active:
                raise Conflict("RL Task is not active")
            if await pipe.scard(open_key):
                return TurnPublication.OPEN
            pipe.multi()
            pipe.set(publish_key, TurnPublication.PUBLISHING)
            pipe.set(keys.turn_publisher(t, turn_id), owner)
            events.queue(pipe, keys.task_events(t), "turn_publishing", {"agent_turn_id": turn_id})
            await pipe.execute()
            return TurnPublication.CLAIMED

        state = await transact(self._redis, body, task_key, open_key, publish_key)
        if state == TurnPublication.CLAIMED:
            self.signals.notify(t)
        return state

    async def publisher(self, rl_task_id: str, turn_id: str) -> str | None:
        """The worker process holding the turn's `publishing` claim ("" for a claim from before workers)."""
        return text(await self._redis.get(keys.turn_publisher(rl_task_id, turn_id)))

    async def take_over_publish(self, rl_task_id: str, turn_id: str, *, dead: str | None, owner: str) -> bool:
        """Move a `publishing` claim from the dead holder `dead` to `owner`; False when the claim changed meanwhile
        (another process took it over first, or the publication ended). Invariant 7: one publisher per turn."""
        t = rl_task_id
        publish_key, publisher_key = keys.turn_publish(t, turn_id), keys.turn_publisher(t, turn_id)

        async def body(pipe: Pipeline) -> bool:
            state, holder = await pipe.mget(publish_key, publisher_key)
            if text(state) != TurnPublication.PUBLISHING or text(holder) != dead:
                return False
            pipe.multi()
            pipe.set(publisher_key, owner)
            await pipe.execute()
            return True

        return await transact(self._redis, body, publish_key, publisher_key)

    async def publish_state(self, rl_task_id: str, turn_id: str) -> TurnPublication | None:
        state = text(await self._redis.get(keys.turn_publish(rl_task_id, turn_id)))
        return None if state is None else TurnPublication(state)

    async def turn_capture_ids(self, rl_task_id: str, turn_id: str) -> list[str]:
        return sorted(text(c) or "" for c in await self._redis.smembers(keys.turn_captures(rl_task_id, turn_id)))

    async def turn_staged(self, rl_task_id: str, turn_id: str) -> list[tuple[str, bytes]]:
        """Staged sample blobs of a turn's committed captures, by capture id."""
        t = rl_task_id
        ids = sorted(text(c) for c in await self._redis.smembers(keys.turn_captures(t, turn_id)))
        if not ids:
            return []
        blobs = await self._redis.mget([keys.staged(t, c) for c in ids])
        return [(c, b) for c, b in zip(ids, blobs) if b is not None]

    async def complete_publish(
        self, rl_task_id: str, turn_id: str, capture_ids: list[str], *, reward: float | None = None, owner: str = "",
        sample_count: int | None = None,
    ) -> None:
        """publishing → published: the turn joins the closed set and its staged samples go, atomically, only while
        the Task is active and this publication (`owner`) still holds the claim. Invariants 3 and 7. `reward` (the
        turn's mean Judge score) goes into the `turn_published` event so a timeline shows what the turn earned, with
        `sample_count` (the turn's samples; its captures when not given)."""
        t = rl_task_id
        task_key, publish_key = keys.task(t), keys.turn_publish(t, turn_id)
        turn_set, publisher_key = keys.turn_captures(t, turn_id), keys.turn_publisher(t, turn_id)

        async def body(pipe: Pipeline) -> None:
            task = await read_task(pipe, task_key)
            if not task.active:
                raise Conflict("RL Task was aborted during turn publication")
            state, holder = await pipe.mget(publish_key, publisher_key)
            # Only `publishing` may become `published`, and only by the process holding the claim (another one
            # took it over when this one was thought dead).
            if not TURN_PUBLICATION_TRANSITIONS.allows(text(state), TurnPublication.PUBLISHED) or \
                    (holder is not None and text(holder) != owner):
                raise Conflict("turn publication lost its claim")
            pipe.multi()
            pipe.set(publish_key, TurnPublication.PUBLISHED)
            pipe.delete(keys.turn_publisher(t, turn_id))
            pipe.sadd(keys.turns_closed(t), turn_id)
            if capture_ids:
                pipe.delete(*(keys.staged(t, c) for c in capture_ids))
            data: dict[str, Any] = {"agent_turn_id": turn_id,
                                    "samples": len(capture_ids) if sample_count is None else sample_count}
            if reward is not None:
                data["reward"] = reward
            events.queue(pipe, keys.task_events(t), "turn_published", data)
            await pipe.execute()

        await transact(self._redis, body, task_key, publish_key, turn_set, publisher_key)
        self.signals.notify(t)

    async def fail_publish(self, rl_task_id: str, turn_id: str, *, fence: Fence = UNFENCED) -> None:
        t = rl_task_id

        def queue(pipe: Pipeline) -> None:  # the state, its holder and its event together
            pipe.set(keys.turn_publish(t, turn_id), TurnPublication.FAILED)
            pipe.delete(keys.turn_publisher(t, turn_id))
            events.queue(pipe, keys.task_events(t), "turn_failed", {"agent_turn_id": turn_id})

        await fence.write(self._redis, queue)
        self.signals.notify(t)

    async def advance_turn(self, rl_task_id: str, from_turn: str, to_turn: str) -> None:
        """current C (published) → T, transition cleared. Idempotent: a second caller finds current = T.
        Invariant 7: current only moves forward after its predecessor is published."""
        t = rl_task_id
        current_key, transition_key = keys.turn_current(t), keys.turn_transition(t)
        publish_key = keys.turn_publish(t, from_turn)

        async def body(pipe: Pipeline) -> None:
            current = text(await pipe.get(current_key))
            if current != from_turn:
                return
            if text(await pipe.get(publish_key)) != TurnPublication.PUBLISHED:
                raise Conflict(f"turn {from_turn} is not published")
            transition = text(await pipe.get(transition_key))
            pipe.multi()
            pipe.set(current_key, to_turn)
            if transition == to_turn:
                pipe.delete(transition_key)
            await pipe.execute()

        await transact(self._redis, body, current_key, transition_key, publish_key)
        self.signals.notify(t)
