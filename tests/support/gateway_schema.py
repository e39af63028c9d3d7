"""An OpenAPI description of the reference gateway's public routes (CONTRACT §3.2–§3.9), for schema-driven fuzzing.

The gateway publishes no OpenAPI document of its own (AIGW does not either); this one is written from the contract
and covers what a client or operator can reach: health, the OpenAI and Anthropic inference routes (unsigned), the
signed control routes proxied to the RL Service, and the LoRA routes. `/v1/rl/service/start|stop` are left out (a
fuzzer stopping the service would only test the 503 path), and `register-instance` has its own operation list
because a valid registration changes where later traffic goes.
"""

from __future__ import annotations

from typing import Any

_ID = {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"}
_TASK_ID = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_MESSAGE = {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": {"type": "string"}},
}
_CHAT = {
    "type": "object", "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
        "stream": {"type": "boolean"},
        "logprobs": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    },
}
_ANTHROPIC_BLOCK = {"type": "object", "required": ["type", "text"],
                    "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
_ANTHROPIC = {
    "type": "object", "required": ["model", "max_tokens", "messages"],
    "properties": {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
        "system": {"type": "string"},
        "stream": {"type": "boolean"},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["user", "assistant"]},
                           "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _ANTHROPIC_BLOCK}]}},
        }},
    },
}


def _body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def _path(name: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema or {"type": "string"}}


def _header(name: str, schema: dict[str, Any], required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": required, "schema": schema}


_OK = {"responses": {"200": {"description": "ok"}}}
_SESSION = _header("X-Agent-Session-Id", _ID)
_TURN = _header("X-Agent-Turn-Id", _ID)

PATHS: dict[str, dict[str, Any]] = {
    "/aigw/v1/health": {"get": {**_OK}},
    "/v1/chat/completions": {"post": {**_OK, **_body(_CHAT), "parameters": [_SESSION, _TURN]}},
    "/v1/messages": {"post": {**_OK, **_body(_ANTHROPIC), "parameters": [_SESSION, _TURN]}},
    "/v1/rl/service": {"get": {**_OK}},
    "/v1/rl/tasks/start": {"post": {**_OK, "parameters": [_header("X-Agent-Session-Id", _ID, required=True)],
                                    **_body({"type": "object", "required": ["reward_mode"], "properties": {
                                        "reward_mode": {"enum": ["terminal", "delayed_feedback"]},
                                        "evaluation": {"type": "boolean"}}})}},
    "/v1/rl/tasks/{rl_task_id}": {"get": {**_OK, "parameters": [_path("rl_task_id", _TASK_ID)]}},
    "/v1/rl/tasks/{rl_task_id}/stop": {"post": {**_OK, "parameters": [_path("rl_task_id", _TASK_ID)]}},
    "/v1/rl/tasks/{rl_task_id}/reward": {"post": {
        **_OK, "parameters": [_path("rl_task_id", _TASK_ID)],
        **_body({"type": "object", "required": ["reward"], "additionalProperties": False,
                 "properties": {"reward": {"type": "number", "minimum": 0, "maximum": 1}}})}},
    "/v1/rl/training/runs": {"post": {**_OK, **_body({"type": "object", "maxProperties": 0}, required=False)}},
    "/v1/rl/training/runs/{training_run_id}": {"get": {**_OK, "parameters": [_path("training_run_id")]}},
    "/v1/rl/training/runs/{training_run_id}/stop": {"post": {**_OK, "parameters": [_path("training_run_id")]}},
    "/v1/rl/trajectories/stats": {"get": {**_OK}},
    "/v1/rl/trajectories": {"get": {**_OK, "parameters": [
        {"name": "status", "in": "query", "schema": {"enum": ["pending", "training", "trained", "failed",
                                                                 "evaluation"]}},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
        {"name": "cursor", "in": "query", "schema": {"type": "string"}},
    ]}},
    "/v1/rl/trajectories/{trajectory_id}": {"get": {**_OK, "parameters": [_path("trajectory_id")]}},
    "/v1/gateway/upload/batch": {"post": {**_OK, **_body({
        "type": "object", "required": ["protocol_version", "session_id", "trajectory_id", "samples"],
        "properties": {"protocol_version": {"enum": ["rail-v1"]}, "session_id": _ID, "trajectory_id": _ID,
                       "samples": {"type": "array", "maxItems": 2}, "session_done": {"type": "boolean"}}})}},
    "/v1/loras/{model}": {"get": {**_OK, "parameters": [_path("model")]},
                          "delete": {"responses": {"204": {"description": "deactivated"}},
                                     "parameters": [_path("model")]}},
}
REGISTER_PATH = "/aigw/v1/register-instance"
REGISTER: dict[str, Any] = {"post": {**_OK, **_body({
    "type": "object", "required": ["name", "model", "instanceIp", "port"],
    "properties": {"name": {"type": "string", "minLength": 1}, "model": {"type": "string", "minLength": 1},
                   "instanceIp": {"type": "string", "minLength": 1}, "port": {"type": "string", "pattern": "^[0-9]+$"},
                   "role": {"enum": ["mixed"]}, "groupID": {"type": "string"}, "dpRank": {"type": "integer"}}})}}

UNSIGNED = {"/aigw/v1/health", "/v1/chat/completions", "/v1/messages"}


def gateway_schema(*, with_register: bool = False) -> dict[str, Any]:
    paths = dict(PATHS)
    if with_register:
        paths[REGISTER_PATH] = REGISTER
    return {"openapi": "3.1.0", "info": {"title": "reference gateway (public routes)", "version": "1"},
            "paths": paths}
