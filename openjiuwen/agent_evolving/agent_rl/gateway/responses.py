"""The gateway's JSON answers: plain bodies, the error envelope, RL Service answers passed through unchanged, and
vLLM error answers made safe to pass on."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from ..common.errors import JSONBody, envelope
from .rl.rl_client import RLAnswer

__all__ = ["envelope", "json_response", "passthrough", "upstream_error"]


def json_response(data: Any, status: int = 200) -> Response:
    return JSONBody(data, status_code=status)


def passthrough(answer: RLAnswer) -> Response:
    return Response(answer.body, status_code=answer.status, media_type=answer.content_type)


def upstream_error(status: int, body: bytes, content_type: str | None) -> Response:
    """A vLLM instance's non-200 answer as the client gets it (issue 19 item 5).

    A JSON object (vLLM's own error shape) passes through byte for byte, always labelled `application/json` whatever
    the instance claimed. Anything else (an HTML page, plain text, a proxy's error page, broken JSON) is never
    relayed: the client gets the gateway's envelope `upstream_error` naming the status and the declared type only,
    so no upstream bytes can be rendered by a browser on the gateway's origin. A status that is not an error status
    (1xx, 2xx other than 200, 3xx) becomes 502: the gateway never relays a redirect or a partial success."""
    code = status if 400 <= status <= 599 else 502
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        return Response(body, status_code=code, media_type="application/json")
    declared = (content_type or "none").split(";", 1)[0].strip()[:100] or "none"
    return envelope(code, "upstream_error",
                    f"the vLLM instance answered {status} with a body that is not a JSON object ({declared})")
