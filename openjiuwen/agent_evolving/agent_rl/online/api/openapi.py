"""Request shapes of the routes, for the OpenAPI document only (CONTRACT §2.4–§2.9).

Routers read bodies by hand (`api/body.py`) so that every mistake gets the contract's own code and order of checks;
FastAPI therefore sees no body model and would publish an empty schema. These `openapi_extra` fragments describe
what a correct request looks like, for readers of `/openapi.json` and for schema-driven fuzzing (schemathesis).
They are documentation: nothing here validates, so changing them never changes an answer.
"""

from __future__ import annotations

from typing import Any

from ...common.ids import MAX_INSTANCE_NAME, TASK_ID_RE, TOKEN_ID_RE
from ..store.sample_status import ALL_SAMPLE_STATUSES
from ...common.wire import headers as wire_headers
from ...common.wire.task_states import TASK_STATUSES, FinishReason, RewardMode

TASK_ID = {"type": "string", "pattern": f"^{TASK_ID_RE.pattern}$"}
TOKEN_ID = {"type": "string", "pattern": f"^{TOKEN_ID_RE.pattern}$"}
_NON_BLANK = {"type": "string", "minLength": 1}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {"role": {"type": "string"}, "content": {"type": ["string", "array", "null"]}},
}
CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": _NON_BLANK,
        "messages": {"type": "array", "items": _MESSAGE},
        "n": {"type": "integer", "enum": [1]},
        "stream": {"type": "boolean"},
        "max_tokens": {"type": "integer", "minimum": 1},
    },
}
_LOGPROB = {"type": "object", "required": ["logprob"], "properties": {"logprob": {"type": "number", "maximum": 0}}}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
CHAT_COMPLETION = {
    "type": "object",
    "required": ["object", "model", "choices", "prompt_token_ids", "usage"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "enum": ["chat.completion"]},
        "model": _NON_BLANK,
        "prompt_token_ids": _TOKEN_IDS,
        "choices": {
            "type": "array",
            "minItems": 1,
            "maxItems": 1,
            "items": {
                "type": "object",
                "required": ["message", "finish_reason", "token_ids", "logprobs"],
                "properties": {
                    "index": {"type": "integer"},
                    "message": {"type": "object"},
                    "finish_reason": _NON_BLANK,
                    "token_ids": _TOKEN_IDS,
                    "logprobs": {
                        "type": "object",
                        "required": ["content"],
                        "properties": {"content": {"type": "array", "items": _LOGPROB}},
                    },
                },
            },
        },
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "completion_tokens": {"type": "integer", "minimum": 0},
                "total_tokens": {"type": "integer", "minimum": 0},
            },
        },
    },
}


def _object(required: list[str], properties: dict[str, Any], *, closed: bool) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "required": required, "properties": properties}
    if closed:
        schema["additionalProperties"] = False
    return schema


def json_body(schema: dict[str, Any], *, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` declaring a JSON request body of this shape."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def header(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": wire_headers.display(name), "in": "header", "required": True, "schema": schema}


def query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


_HOOK_IDS = {"rl_task_id": TASK_ID, "capture_id": TOKEN_ID, "agent_turn_id": {"anyOf": [TOKEN_ID, {"type": "null"}]}}

TASK_START = {
    **json_body(_object(["reward_mode"], {"reward_mode": {"enum": [m.value for m in RewardMode]},
                                          "evaluation": {"type": "boolean"}}, closed=True)),
    "parameters": [
        header(wire_headers.SESSION_ID, TOKEN_ID),
        header(wire_headers.TASK_ID, TASK_ID),
        header(wire_headers.POLICY_NAME, _NON_BLANK),
        header(wire_headers.POLICY_MODEL, _NON_BLANK),
    ],
}
TASK_STOP = json_body({"type": "object"}, required=False)  # ignored by the route
TASK_REWARD = json_body(_object(["reward"], {"reward": {"type": "number", "minimum": 0, "maximum": 1}}, closed=True))
HOOK_BEFORE = json_body(_object(["rl_task_id", "capture_id", "request"], {**_HOOK_IDS, "request": CHAT_REQUEST},
                                closed=True))
_INSTANCE = {"type": "string", "minLength": 1, "maxLength": MAX_INSTANCE_NAME}
HOOK_AFTER = json_body(_object(["rl_task_id", "capture_id", "request", "response"],
                               {**_HOOK_IDS, "request": CHAT_REQUEST, "response": CHAT_COMPLETION,
                                "instance": {"anyOf": [_INSTANCE, {"type": "null"}]}}, closed=True))
HOOK_DISCARD = json_body(_object(["rl_task_id", "capture_id"], _HOOK_IDS, closed=True))
TASK_FINISH = json_body(_object(["reason"], {"reason": {"enum": [FinishReason.SERVICE_STOPPED.value]}}, closed=True))
TASK_ABORT = json_body(_object(
    ["reason"], {"reason": {"enum": [FinishReason.CAPTURE_FAILED.value, FinishReason.TIMEOUT.value]}}, closed=True,
))
TRAINING_START = json_body({"anyOf": [{"type": "null"}, _object([], {}, closed=True)]}, required=False)
# promote / rollback / pause / resume: absent, null, {} (the default line) or {"lineage": L} (L's line)
ROLLOUT_ACTION = json_body({"anyOf": [{"type": "null"}, _object([], {
    "lineage": {"type": "string", "pattern": "^[a-z0-9-]{1,63}$"}}, closed=True)]}, required=False)
LINEAGE_ACTION = TRAINING_START  # lineage pause / resume / archive / restore: no body
# lineage delete: absent, null, {} (files kept) or {"remove_files": true|false}
LINEAGE_DELETE = json_body({"anyOf": [{"type": "null"}, _object([], {"remove_files": {"type": "boolean"}},
                                                              closed=True)]}, required=False)
LORA_ACTIVATE = json_body(_object(["lora_name"], {"lora_name": {"type": "string", "minLength": 1}}, closed=True))
_LIMIT = query("limit", {"type": "integer", "minimum": 1, "maximum": 1000})
_CURSOR = query("cursor", {"type": "string"})
_LINEAGE = query("lineage", {"type": "string", "pattern": "^[a-z0-9-]{1,63}$"})  # absent: the default line
TRAJECTORY_LIST = {
    "parameters": [
        query("status", {"enum": [s.value for s in ALL_SAMPLE_STATUSES]}),
        _LIMIT, _CURSOR, _LINEAGE,
    ],
}
TRAJECTORY_STATS = {"parameters": [_LINEAGE]}
TASK_LIST = {"parameters": [query("status", {"enum": [s.value for s in TASK_STATUSES]}), _LIMIT, _CURSOR]}
RUN_LIST = {"parameters": [_LIMIT, _CURSOR]}
LINEAGE_LIST = {"parameters": [_LIMIT, _CURSOR]}
POLICY_LIST = {"parameters": [_LINEAGE]}
ROLLOUT_STATUS = POLICY_LIST  # `?lineage=`: that line's rollout
_REWARD_SOURCE = {"type": "string", "pattern": "^[a-z0-9_-]{1,32}$"}
_SCORE = {"type": "number", "minimum": 0, "maximum": 1}
TRAJECTORY_REWARD = json_body(_object(["source", "score"], {"source": _REWARD_SOURCE, "score": _SCORE}, closed=True))
TRAJECTORY_REWARDS = json_body(_object(["rewards"], {"rewards": {
    "type": "array", "minItems": 1, "maxItems": 1000,
    "items": _object(["trajectory_id", "source", "score"],
                     {"trajectory_id": {"type": "string", "minLength": 1}, "source": _REWARD_SOURCE, "score": _SCORE},
                     closed=True),
}}, closed=True))
TRAJECTORY_EXCLUDE = json_body(_object(["instance"], {"instance": _INSTANCE}, closed=True))
_RAIL_SAMPLE = _object(
    ["messages", "prompt_ids", "response_tokens", "logprobs", "response"],
    {
        "messages": {"type": "array", "items": _MESSAGE},
        "prompt_ids": _TOKEN_IDS,
        "response_tokens": _TOKEN_IDS,
        "logprobs": {"type": "array", "items": {"type": "number", "maximum": 0}},
        "response": {"type": "object"},
        "tools": {"type": "array"},
        "step_index": {"type": "integer", "minimum": 0},
    },
    closed=False,
)
RAIL_BATCH = json_body(_object(
    ["protocol_version", "session_id", "trajectory_id", "samples"],
    {
        "protocol_version": {"enum": ["rail-v1"]},
        "session_id": TOKEN_ID,
        "trajectory_id": TOKEN_ID,
        "samples": {"type": "array", "items": _RAIL_SAMPLE},
        "prev_feedback": {"type": "object", "properties": {"text": {"type": "string"}}},
        "session_done": {"type": "boolean"},
        "trajectory_meta": {"type": "object"},
    },
    closed=False,
))
