"""Shape validation of the capture hook bodies (CONTRACT §2.8): keys present, types right, ids well-formed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import invalid_completion
from ...common.ids import MAX_INSTANCE_NAME, is_instance_name, is_task_id, is_token_id


@dataclass(frozen=True, slots=True)
class HookBody:
    rl_task_id: str
    capture_id: str
    agent_turn_id: str | None
    request: Any = None
    response: Any = None
    instance: str | None = None  # the vLLM instance that served the completion (ext; an AIGW sends none)



def parse_hook(body: dict[str, Any], *, with_request: bool, with_response: bool) -> HookBody:
    required = ["rl_task_id", "capture_id"]
    if with_request:
        required.append("request")
    if with_response:
        required.append("response")
    for name in required:
        if name not in body:
            raise invalid_completion(f"missing field: {name}")
    t, c = body["rl_task_id"], body["capture_id"]
    if not isinstance(t, str) or not isinstance(c, str):
        raise invalid_completion("rl_task_id and capture_id must be strings")
    if not is_task_id(t):
        raise invalid_completion("rl_task_id has an invalid format")
    if not is_token_id(c):
        raise invalid_completion("capture_id has an invalid format")
    turn = body.get("agent_turn_id")
    if turn is not None:
        if not isinstance(turn, str):
            raise invalid_completion("agent_turn_id must be a string or null")
        if not is_token_id(turn):
            raise invalid_completion("agent_turn_id has an invalid format")
    if with_request and not isinstance(body["request"], dict):
        raise invalid_completion("request must be an object")
    if with_response and not isinstance(body["response"], dict):
        raise invalid_completion("response must be an object")
    instance = body.get("instance") if with_response else None
    if instance is not None and not is_instance_name(instance):
        raise invalid_completion(f"instance must be a printable string of 1..{MAX_INSTANCE_NAME} characters or null")
    return HookBody(t, c, turn, body.get("request"), body.get("response"), instance)
