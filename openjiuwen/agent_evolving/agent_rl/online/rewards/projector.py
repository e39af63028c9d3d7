"""Terminal rewards: claim, project every staged sample into the trajectory store, complete (CONTRACT §4.4).

The claim writes `projecting` before any sample is inserted, so a crash in between is repaired by the same reward
call or by the retention sweeper, and insert-if-absent makes the repeat harmless.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from .. import events
from ..errors import Conflict, InvalidInput, NotFound
from .. import faults
from ...common.ids import is_token_id, now_iso, parse_iso_epoch
from ..store import keys
from ..store.codec import PackedSample
from ..store.policy_stats import add_task_reward
from ..store.sample_publisher import SamplePublisher
from ..store.tx import transact
from ...common.wire.task_states import RewardMode, TaskStatus
from ..tasks.task_records import TERMINAL_REWARD_TRANSITIONS, Task, TerminalReward


def parse_reward_body(body: dict[str, Any]) -> float:
    if set(body) != {"reward"}:
        raise InvalidInput("invalid_reward_request", "body must be exactly {\"reward\": <number>}")
    value = body["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput("invalid_reward", "reward must be a number between 0 and 1")
    value = float(value)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise InvalidInput("invalid_reward", "reward must be a number between 0 and 1")
    return value


class RewardProjector:
    def __init__(self, redis: Redis, samples: SamplePublisher) -> None:
        self._redis = redis
        self._samples = samples

    async def reward(self, rl_task_id: str, value: float, *, agent_key: str | None = None) -> int:
        """The terminal reward of a finalized Task; the number of samples it published. `agent_key`: the calling
        gateway agent key (None for the operator): another key's Task is NotFound."""
        t = rl_task_id
        task_key, reward_key, committed_key = keys.task(t), keys.reward(t), keys.committed_captures(t)

        async def claim(pipe: Pipeline) -> int | None:
            raw = await pipe.get(task_key)
            if raw is None:
                raise NotFound("RL Task not found")
            task = Task.from_json(raw)
            if not task.answers_to(agent_key):
                raise NotFound("RL Task not found")
            if task.reward_mode != RewardMode.TERMINAL:
                raise Conflict("terminal reward is not accepted for delayed_feedback Tasks")
            if task.status != TaskStatus.FINALIZED:
                raise Conflict("terminal reward requires a finalized Task")
            if not await pipe.scard(committed_key):
                raise Conflict("terminal reward requires at least one capture")
            state_raw = await pipe.get(reward_key)
            if state_raw is not None:
                state = orjson.loads(state_raw)
                if state["status"] == TerminalReward.EXPIRED:
                    raise Conflict("the reward window of this Task expired")
                if state["reward"] != value:
                    raise Conflict("RL Task already has a different reward")
                if state["status"] == TerminalReward.PUBLISHED:
                    return int(state["sample_count"])
                return None  # `projecting` with the same reward: finish the interrupted projection
            pipe.multi()
            pipe.set(reward_key, orjson.dumps({
                "reward": value, "status": TerminalReward.PROJECTING, "sample_count": 0,
            }))
            await pipe.execute()
            return None

        count = await transact(self._redis, claim, task_key, reward_key, committed_key)
        if count is not None:
            return count
        faults.reached("reward.claimed")
        return await self.project(t, value)

    async def resume_interrupted(self, *, batch: int = 500) -> int:
        """Startup: finish every projection a crash left `projecting` (its Task waits in the awaiting-reward index),
        rather than leave it half published until the sweeper's reward timeout. Safe beside a live projection in
        another process: insert-if-absent and the completion are idempotent. Returns the number resumed."""
        resumed, start = 0, 0
        while True:
            ids = [c.decode() for c in await self._redis.zrange(keys.TASKS_AWAITING_REWARD, start, start + batch - 1)]
            if not ids:
                return resumed
            done = 0
            for t, raw in zip(ids, await self._redis.mget([keys.reward(t) for t in ids])):
                state = orjson.loads(raw) if raw else None
                if isinstance(state, dict) and state.get("status") == TerminalReward.PROJECTING:
                    await self.project(t, float(state["reward"]))
                    done += 1
            resumed += done
            start += len(ids) - done  # each completed projection left the index

    async def project(self, rl_task_id: str, value: float) -> int:
        """Copy each staged sample with `judge = {score, source: terminal}` into the store, then complete."""
        t = rl_task_id
        committed = sorted(c.decode() for c in await self._redis.smembers(keys.committed_captures(t)))
        blobs = await self._redis.mget([keys.staged(t, c) for c in committed]) if committed else []
        samples = []
        for blob in blobs:
            if blob is None:
                continue  # already projected and deleted by a concurrent completion
            for sample in PackedSample.decode_staged_all(blob):  # one per choice of an `n` > 1 capture
                sample.meta["judge"] = {"score": value, "source": "terminal"}
                samples.append(sample)
        if samples:
            await self._samples.insert_if_absent(samples)
            faults.reached("reward.inserted")
        reward_key = keys.reward(t)

        # Every blob is still there while the projection is not published (they go only with the completion below,
        # which answers from the state when a concurrent one got there first): this is the Task's sample count.
        sample_count = len(samples)

        # Invariants 3 and 4: the staged copies disappear in the same step that marks the reward published, and
        # the Task leaves the awaiting-reward index for the gc index.
        async def complete(pipe: Pipeline) -> int:
            state = orjson.loads(await pipe.get(reward_key) or b'{"status": "missing"}')
            if state.get("status") == TerminalReward.PUBLISHED:
                return int(state["sample_count"])
            if not TERMINAL_REWARD_TRANSITIONS.allows(state.get("status"), TerminalReward.PUBLISHED):
                raise Conflict("reward projection lost its claim")
            raw_task = await pipe.get(keys.task(t))
            task = Task.from_json(raw_task) if raw_task is not None else None
            policy = task.policy_lora_name if task is not None else None
            pipe.multi()
            if task is not None and policy is not None and is_token_id(policy):
                # The version's reward statistics gain this Task's reward exactly once, with its publication.
                add_task_reward(pipe, keys.policy_stats(policy), value, evaluation=task.evaluation)
                pipe.sadd(keys.POLICY_VERSIONS, policy)
            pipe.set(
                reward_key,
                orjson.dumps({"reward": value, "status": TerminalReward.PUBLISHED, "sample_count": sample_count}),
            )
            if committed:
                pipe.delete(*(keys.staged(t, c) for c in committed))
            pipe.zrem(keys.TASKS_AWAITING_REWARD, t)
            pipe.zadd(keys.TASKS_GC, {t: parse_iso_epoch(now_iso())})
            events.queue(pipe, keys.task_events(t), "reward_recorded",
                         {"reward": value, "sample_count": sample_count})
            await pipe.execute()
            return sample_count

        return await transact(self._redis, complete, reward_key)
