"""The gateway's JSON answers: plain bodies, the error envelope, and RL Service answers passed through unchanged."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from .rl_client import RLAnswer


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def envelope(status: int, code: str, message: str) -> Response:
    return json_response({"error": {"code": code, "message": message}}, status)


def passthrough(answer: RLAnswer) -> Response:
    return Response(answer.body, status_code=answer.status, media_type=answer.content_type)
