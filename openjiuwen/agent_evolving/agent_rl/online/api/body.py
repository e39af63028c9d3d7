"""Reading request bodies once, with orjson, into the shapes routes expect."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request

from ...common.errors import ApiError


async def json_value(request: Request) -> Any:
    """Any JSON value of the body (None when the body is empty). Malformed JSON → 400 `invalid_request`."""
    raw = await request.body()
    if not raw.strip():
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, "invalid_request", "request body is not valid JSON") from exc


async def json_object(
    request: Request, *, allow_empty: bool = False, lenient: bool = False
) -> dict[str, Any] | None:
    """The body as a JSON object (`parse_json_object` of the body)."""
    return parse_json_object(await request.body(), allow_empty=allow_empty, lenient=lenient)


def parse_json_object(raw: bytes, *, allow_empty: bool = False, lenient: bool = False) -> dict[str, Any] | None:
    """A body as a JSON object. Malformed JSON or a non-object → 400 `invalid_request`.

    With `allow_empty`, an absent body or `null` gives None. With `lenient`, NaN and Infinity are read as numbers
    so that the route can refuse them with its own code."""
    if not raw.strip():
        if allow_empty:
            return None
        raise ApiError(400, "invalid_request", "request body must be a JSON object")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if not lenient:
            raise ApiError(400, "invalid_request", "request body is not valid JSON") from exc
        value = _lenient_loads(raw)
    if value is None and allow_empty:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "invalid_request", "request body must be a JSON object")
    return value


def _lenient_loads(raw: bytes) -> Any:
    """orjson refuses NaN/Infinity; the stdlib accepts them, so routes can answer with their own precise code
    (e.g. `invalid_reward` for a NaN reward) instead of a generic parse error."""
    import json

    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, "invalid_request", "request body is not valid JSON") from exc
