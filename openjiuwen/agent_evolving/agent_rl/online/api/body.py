"""Reading request bodies once, with orjson, into the shapes routes expect. Every body is held to the JSON nesting
bound (common/json_nesting.py): deeper is 400 `invalid_request`, before any route rule."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request

from ...common import json_nesting
from ...common.errors import ApiError


async def json_value(request: Request) -> Any:
    """Any JSON value of the body (None when the body is empty). Malformed JSON → 400 `invalid_request`."""
    raw = await request.body()
    if not raw.strip():
        return None
    try:
        return json_nesting.loads(raw)
    except json_nesting.TooDeep as exc:
        raise _too_deep(exc) from None
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, "invalid_request", "request body is not valid JSON") from exc


async def json_object(
    request: Request, *, allow_empty: bool = False, lenient: bool = False
) -> dict[str, Any] | None:
    """The body as a JSON object (`parse_json_object` of the body)."""
    return parse_json_object(await request.body(), allow_empty=allow_empty, lenient=lenient)


def parse_json_object(
    raw: bytes, *, allow_empty: bool = False, lenient: bool = False, max_depth: int = json_nesting.MAX_DEPTH,
) -> dict[str, Any] | None:
    """A body as a JSON object. Malformed JSON, nesting past `max_depth` or a non-object → 400 `invalid_request`.

    With `allow_empty`, an absent body or `null` gives None. With `lenient`, NaN and Infinity are read as numbers
    so that the route can refuse them with its own code."""
    if not raw.strip():
        if allow_empty:
            return None
        raise ApiError(400, "invalid_request", "request body must be a JSON object")
    try:
        value = json_nesting.loads(raw, max_depth=max_depth)
    except json_nesting.TooDeep as exc:
        raise _too_deep(exc) from None
    except orjson.JSONDecodeError as exc:
        if not lenient:
            raise ApiError(400, "invalid_request", "request body is not valid JSON") from exc
        value = _lenient_loads(raw, max_depth)
    if value is None and allow_empty:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "invalid_request", "request body must be a JSON object")
    return value


def _lenient_loads(raw: bytes, max_depth: int) -> Any:
    """orjson refuses NaN/Infinity; the stdlib accepts them, so routes can answer with their own precise code
    (e.g. `invalid_reward` for a NaN reward) instead of a generic parse error."""
    import json

    try:
        # Decoded as `json.loads(bytes)` does (UTF-8, -16 or -32 by the first bytes), so that the nesting check
        # scans the text the value was read from.
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, "invalid_request", "request body is not valid JSON") from exc
    try:
        json_nesting.check_depth(value, max_depth=max_depth, text=text)
    except json_nesting.TooDeep as exc:
        raise _too_deep(exc) from None
    return value


def _too_deep(exc: json_nesting.TooDeep) -> ApiError:
    return ApiError(400, "invalid_request", f"request body is {exc}")
