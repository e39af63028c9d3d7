"""The lineage of a Task start (docs/lineages.md "## Gateway", wire 1): read from the signed body, which is forwarded
as it came (never re-encoded for this), and told to the RL Service in `X-AIGW-RL-Lineage` (common/wire/headers.py)."""

from __future__ import annotations

from typing import Any

import orjson

from ...common import json_nesting
from ...common.lineage import DEFAULT_LINEAGE, require_lineage

LINEAGE_FIELD = "lineage"


def decode_start_body(body: bytes) -> dict[str, Any] | None:
    """The start body as a JSON object, decoded once for every gateway field read from it; None when it is not one
    (too deep included): the RL Service refuses such a body with its own words."""
    try:
        data = json_nesting.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def requested_lineage(data: dict[str, Any] | None) -> str:
    """The decoded body's `lineage` (absent, or no JSON object: `default`); InvalidLineage when it is no lineage
    name."""
    if data is None or LINEAGE_FIELD not in data:
        return DEFAULT_LINEAGE
    return require_lineage(data[LINEAGE_FIELD])
