"""Public Task routes (CONTRACT §2.4, §2.5).

The gateway names the agent key behind a call in `X-AIGW-RL-Agent-Key` (ext): on start the Task's owner, on stop and
reward the caller, who is answered 404 for a Task another key started. Without the header (the operator, an AIGW)
every Task is the caller's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from ...common.wire import routes as rl_routes
from ..tasks.lifecycle import StartHeaders, TaskLifecycle
from ..rewards.projector import RewardProjector, parse_reward_body
from ...common.wire.task_states import FinishReason
from ..tasks.task_records import Task
from ..store.keys import TASK_STATUSES
from ..tasks.registry import TaskRegistry
from . import openapi
from .body import json_object
from ...common.errors import ApiError, JSONBody
from ...common.wire import headers as wire_headers
from .errors import domain_errors
from ..lineages import LineageRegistry
from .lineages import lineage_param
from .paging import cursor_param, limit_param, status_param


def build_tasks_router(registry: TaskRegistry, lifecycle: TaskLifecycle, rewards: RewardProjector,
                       lineages: LineageRegistry, *, on_created: Callable[[Task], Awaitable[None]] | None = None) -> APIRouter:
    """`on_created`: told of each new Task (the rollout marks its arm in the Task's timeline)."""
    router = APIRouter()

    @router.post(rl_routes.TASK_START.path, openapi_extra=openapi.TASK_START)
    async def start_task(request: Request) -> JSONBody:
        body = await json_object(request)
        assert body is not None
        h = request.headers
        headers = StartHeaders(
            h.get(wire_headers.SESSION_ID), h.get(wire_headers.TASK_ID), h.get(wire_headers.POLICY_NAME),
            h.get(wire_headers.POLICY_MODEL), h.get(wire_headers.AGENT_KEY), h.get(wire_headers.LINEAGE),
            h.get(wire_headers.MAX_LINEAGES),
        )
        with domain_errors(not_found="task_not_found", conflict="task_conflict"):
            requested = lifecycle.parse_start(headers, body)
            task, created = await registry.start(requested, lineage_cap=lifecycle.lineage_cap(headers))
        if created and on_created is not None:
            await on_created(task)
        return JSONBody(task.public(), status_code=201 if created else 200)

    @router.get(rl_routes.TASK_LIST.path, openapi_extra=openapi.TASK_LIST)
    async def list_tasks(request: Request) -> JSONBody:
        """Task records newest first by creation, optionally one status and one lineage (`?lineage=`, ext:
        docs/lineages.md); `next_cursor` is null on the last page."""
        params = request.query_params
        status, limit, cursor = status_param(params, TASK_STATUSES), limit_param(params), cursor_param(params)
        lineage = await lineage_param(params, lineages)
        with domain_errors(not_found="task_not_found", conflict="task_conflict"):
            return JSONBody(await registry.list_page(status, limit, cursor, lineage))

    @router.get(rl_routes.TASK_EVENTS.path)
    async def task_events(rl_task_id: str) -> JSONBody:
        """The Task timeline, oldest first (bounded to about 1000 entries)."""
        with domain_errors(not_found="task_not_found", conflict="task_conflict"):
            return JSONBody({"items": await registry.events(rl_task_id)})

    @router.get(rl_routes.TASK.path)
    async def get_task(rl_task_id: str) -> dict[str, Any]:
        with domain_errors(not_found="task_not_found", conflict="task_conflict"):
            task = await registry.require(rl_task_id)
        return task.public()

    @router.post(rl_routes.TASK_STOP.path, openapi_extra=openapi.TASK_STOP)
    async def stop_task(rl_task_id: str, request: Request) -> dict[str, Any]:
        # The body is ignored (CONTRACT §2.5), so it is never parsed.
        with domain_errors(not_found="task_not_found", conflict="task_conflict"):
            task = await lifecycle.finish(rl_task_id, FinishReason.USER_STOPPED,
                                          agent_key=request.headers.get(wire_headers.AGENT_KEY))
        return task.public()

    @router.post(rl_routes.TASK_REWARD.path, openapi_extra=openapi.TASK_REWARD)
    async def reward_task(rl_task_id: str, request: Request) -> dict[str, Any]:
        body = await json_object(request, lenient=True)  # a NaN reward is `invalid_reward`, not a parse error
        assert body is not None
        with domain_errors(not_found="task_not_found", conflict="reward_conflict"):
            value = parse_reward_body(body)
            count = await rewards.reward(rl_task_id, value, agent_key=request.headers.get(wire_headers.AGENT_KEY))
        return {"sample_count": count}

    return router


def reason_from_body(body: dict[str, Any], allowed: set[str], code: str) -> FinishReason:
    reason = body.get("reason")
    if set(body) != {"reason"} or not isinstance(reason, str) or reason not in allowed:
        raise ApiError(400, code, f"body must be exactly {{\"reason\": one of {sorted(allowed)}}}")
    return FinishReason(reason)
