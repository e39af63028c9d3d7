"""The lineage of a Task start (docs/lineages.md "## Gateway", wire 1): read from the signed body, which is forwarded
as it came (never re-encoded for this), and told to the RL Service in `X-AIGW-RL-Lineage` (common/wire/headers.py)."""

from __future__ import annotations

import orjson

from ..common import json_nesting
from ..common.lineage import DEFAULT_LINEAGE, InvalidLineage, require_lineage

LINEAGE_FIELD = "lineage"


def requested_lineage(body: bytes) -> str:
    """The body's `lineage` (absent: `default`); InvalidLineage when it is no lineage name. A body that is
    not a JSON object has no lineage here: the RL Service refuses it with its own words."""
    try:
        data = json_nesting.loads(body)
    except orjson.JSONDecodeError:
        return DEFAULT_LINEAGE
    if not isinstance(data, dict) or LINEAGE_FIELD not in data:
        return DEFAULT_LINEAGE
    return require_lineage(data[LINEAGE_FIELD])
