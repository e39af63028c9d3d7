"""External reward routes (docs/rewards.md): attach a source's score to a published sample, one or many."""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request

from ...common.wire import routes as rl_routes
from ..errors import InvalidInput
from ..rewards.ledger import RewardLedger
from . import openapi
from .body import json_object
from ...common.errors import ApiError
from .errors import domain_errors

MAX_BATCH = 1000
_SCORE_MESSAGE = "score must be a number between 0 and 1"


def build_rewards_router(ledger: RewardLedger) -> APIRouter:
    router = APIRouter()

    @router.post(rl_routes.TRAJECTORY_REWARDS.path, openapi_extra=openapi.TRAJECTORY_REWARDS)
    async def attach_rewards(request: Request) -> dict[str, Any]:
        """Batch form: every item is answered on its own (`ok` and the single route's answer or error)."""
        body = await json_object(request, lenient=True)
        assert body is not None
        items = body.get("rewards")
        if set(body) != {"rewards"} or not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH:
            raise ApiError(
                400, "invalid_reward_request", f"body must be exactly {{\"rewards\": [1..{MAX_BATCH} items]}}"
            )
        return {"results": [await _attach_item(ledger, item) for item in items]}

    @router.post(rl_routes.TRAJECTORY_REWARD.path, openapi_extra=openapi.TRAJECTORY_REWARD)
    async def attach_reward(trajectory_id: str, request: Request) -> dict[str, Any]:
        """Idempotent per (sample, source); 409 `reward_conflict` for another score or a sample already claimed."""
        body = await json_object(request, lenient=True)  # a NaN score is `invalid_reward`, not a parse error
        assert body is not None
        with domain_errors(not_found="trajectory_not_found", conflict="reward_conflict"):
            source, score = parse_reward(body, fields=frozenset({"source", "score"}))
            return await ledger.attach(trajectory_id, source, score)

    return router


def parse_reward(body: dict[str, Any], *, fields: frozenset[str]) -> tuple[str, float]:
    if set(body) != fields or not isinstance(body.get("source"), str):
        raise InvalidInput("invalid_reward_request", "body must be exactly {\"source\": <name>, \"score\": <number>}")
    score = body["score"]
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise InvalidInput("invalid_reward", _SCORE_MESSAGE)
    score = float(score)
    if not math.isfinite(score) or not 0.0 <= score <= 1.0:
        raise InvalidInput("invalid_reward", _SCORE_MESSAGE)
    return body["source"], score


async def _attach_item(ledger: RewardLedger, item: Any) -> dict[str, Any]:
    trajectory_id = item.get("trajectory_id") if isinstance(item, dict) else None
    try:
        if not isinstance(item, dict) or not isinstance(trajectory_id, str):
            raise InvalidInput("invalid_reward_request", "each item is {\"trajectory_id\", \"source\", \"score\"}")
        with domain_errors(not_found="trajectory_not_found", conflict="reward_conflict"):
            source, score = parse_reward(item, fields=frozenset({"trajectory_id", "source", "score"}))
            return {"ok": True, **await ledger.attach(trajectory_id, source, score)}
    except InvalidInput as exc:
        return _item_error(trajectory_id, exc.code or "invalid_reward_request", exc.message)
    except ApiError as exc:
        return _item_error(trajectory_id, exc.code, exc.message)


def _item_error(trajectory_id: Any, code: str, message: str) -> dict[str, Any]:
    shown = trajectory_id if isinstance(trajectory_id, str) and len(trajectory_id) <= 300 else None
    return {"ok": False, "trajectory_id": shown, "error": {"code": code, "message": message}}
