"""Query parameters of the paged listings (`status`, `limit`, `cursor`): any invalid one is 400 `invalid_request`."""

from __future__ import annotations

import re
from collections.abc import Sequence

from starlette.datastructures import QueryParams

from ...common.errors import ApiError

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
_DIGITS = re.compile(r"[0-9]{1,4}")


def status_param(params: QueryParams, allowed: Sequence[str]) -> str | None:
    status = params.get("status") or None  # an empty value means absent, like a missing parameter
    if status is not None and status not in allowed:
        raise ApiError(400, "invalid_request", f"status must be one of {', '.join(allowed)}")
    return status


def limit_param(params: QueryParams) -> int:
    raw = params.get("limit") or None
    if raw is None:
        return DEFAULT_LIMIT
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= MAX_LIMIT:
        raise ApiError(400, "invalid_request", f"limit must be an integer between 1 and {MAX_LIMIT}")
    return int(raw)


def cursor_param(params: QueryParams) -> str | None:
    return params.get("cursor") or None
