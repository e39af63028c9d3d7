"""Event timelines: every Task and Training Run appends its transitions to a bounded Redis Stream (CONTRACT §2.5,
§2.6, §5.1).

An entry has the fields `type`, `at` (ISO-8601 UTC) and `data` (JSON). Events of a state transition are queued with
`queue` inside that transition's MULTI (or appended by its Lua script, capture/scripts.py, with the same
fields and MAXLEN), so the timeline and the state never disagree; other events (an activation
attempt, a stop request) go through `append`, best-effort: a failure is logged and never fails the caller.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from ..common.ids import now_iso
from .store.codec import text

log = logging.getLogger("openjiuwen.agent_rl.online.events")

MAXLEN = 1000  # approximate (`MAXLEN ~`): Redis trims whole macro nodes, so a stream may hold a few more

TASK_EVENT_TYPES = (
    "created", "capture_reserved", "capture_committed", "capture_discarded", "turn_publishing", "turn_published",
    "turn_failed", "finalized", "aborted", "reward_recorded", "reward_expired", "rollout_arm",
)
RUN_EVENT_TYPES = (
    "created", "training_started", "waiting_for_resources", "resources_placed", "ppo_step", "artifact_published", "samples_trained", "activation_attempt",
    "activation_succeeded", "activation_failed", "stop_requested", "canceled", "failed", "succeeded", "recovered",
    "candidate_loaded", "canary_started", "canary_promoted", "canary_rolled_back",
)
ROLLOUT_EVENT_TYPES = (
    "canary_started", "promotion_started", "rollback_started", "canary_promoted", "canary_rolled_back", "paused",
    "resumed", "activation_requested", "version_activated", "failed",
)


def encode_data(data: dict[str, Any] | None) -> bytes:
    """An entry's `data` field as stored (the capture scripts of capture/scripts.py take it ready-made)."""
    return orjson.dumps(data or {})


def _fields(event_type: str, data: dict[str, Any] | None, at: str | None) -> dict[str, bytes | str]:
    return {"type": event_type, "at": at or now_iso(), "data": encode_data(data)}


def queue(pipe: Pipeline, stream_key: str, event_type: str, data: dict[str, Any] | None = None, *,
          at: str | None = None) -> None:
    """Queue one XADD inside the caller's MULTI (a transition event: it commits or fails with the transition)."""
    pipe.xadd(stream_key, _fields(event_type, data, at), maxlen=MAXLEN, approximate=True)


class EventLog:
    """Best-effort appends and reads of the timelines."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    async def append(self, stream_key: str, event_type: str, data: dict[str, Any] | None = None) -> None:
        try:
            await self._redis.xadd(stream_key, _fields(event_type, data, None), maxlen=MAXLEN, approximate=True)
        except RedisError as exc:
            log.warning("event %s could not be appended to %s: %s", event_type, stream_key, exc)

    async def read(self, stream_key: str) -> list[dict[str, Any]]:
        """The timeline oldest first: `[{"id", "at", "type", "data"}]`."""
        entries = await self._redis.xrange(stream_key, "-", "+", count=MAXLEN * 2)
        items = []
        for entry_id, fields in entries:
            decoded = {text(k): v for k, v in fields.items()}
            try:
                data = orjson.loads(decoded.get("data") or b"{}")
            except orjson.JSONDecodeError:
                data = {}
            items.append({
                "id": text(entry_id), "at": text(decoded.get("at")), "type": text(decoded.get("type")), "data": data,
            })
        return items
