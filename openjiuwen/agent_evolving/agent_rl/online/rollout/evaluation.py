"""A canary's evaluation (docs/rollout.md "Decision"): its two arms as the durable Task records and reward states
of its window have them, and the decision `decide` (decision.py) would take on them now. Reads only."""

from __future__ import annotations

import orjson
from redis.asyncio import Redis

from ...common.ids import now_iso, parse_iso_epoch
from ...common.lineage import DEFAULT_LINEAGE
from ..store import keys
from ..store.codec import text
from .config import RolloutConfig
from .decision import Arm, Decision, decide
from .record import Rollout

_SCAN_BATCH = 500


class CanaryEvaluation:
    def __init__(self, redis: Redis, config: RolloutConfig) -> None:
        self._redis = redis
        self._config = config

    async def evaluate(self, record: Rollout) -> Decision:
        candidate, active = await self.arms(record)
        elapsed = parse_iso_epoch(now_iso()) - parse_iso_epoch(record.window_started_at)
        return decide(candidate, active, self._config, elapsed)

    async def arms(self, record: Rollout) -> tuple[Arm, Arm]:
        """The Tasks created in the canary window, by the version they were pinned to. Read from the Task records
        and their reward states (durable): a restart loses nothing, and older history never counts. Only the line's
        own Tasks are read, from its lineage's creation index (`rl:v1:tasks:by_lineage:{L}`, written in the Task
        start's EXEC), so a decision round costs O(the line's Tasks in the window), never every lineage's."""
        candidate = Arm(record.candidate.lora_name)
        active = Arm(record.baseline.lora_name)
        by_name = {candidate.lora_name: candidate, active.lora_name: active}
        # Only the line's own Tasks count: `base` is every line's baseline before its first version.
        lineage = record.lineage
        start = parse_iso_epoch(record.window_started_at)
        end = parse_iso_epoch(record.ended_at) if record.ended_at else "+inf"
        ids = [text(t) for t in await self._redis.zrangebyscore(keys.tasks_by_lineage(lineage), start, end)]
        for offset in range(0, len(ids), _SCAN_BATCH):
            chunk = ids[offset:offset + _SCAN_BATCH]
            raws = await self._redis.mget([keys.task(t) for t in chunk])
            finalized: list[tuple[str, Arm]] = []
            for t, raw in zip(chunk, raws):
                task = orjson.loads(raw) if raw is not None else None
                arm = by_name.get(task.get("policy_lora_name")) if isinstance(task, dict) else None
                if arm is None or (task.get("lineage") or DEFAULT_LINEAGE) != lineage:  # the index says so; kept
                    continue
                arm.tasks += 1
                if task.get("evaluation") is True:  # evaluation Tasks count too, and are shown apart
                    arm.evaluation += 1
                if task.get("status") == "aborted":
                    arm.ended += 1
                    arm.failed += 1
                elif task.get("status") == "finalized":
                    arm.ended += 1
                    finalized.append((t, arm))
            if finalized:
                rewards = await self._redis.mget([keys.reward(t) for t, _ in finalized])
                for (_, arm), raw in zip(finalized, rewards):
                    state = orjson.loads(raw) if raw is not None else None
                    if isinstance(state, dict) and state.get("status") == "published":
                        arm.add_reward(float(state["reward"]))
        return candidate, active
