"""A lineage's lifecycle state (docs/lineages.md "Lifecycle"): live, archived or being deleted.

One STRING per non-default lineage, `rl:v1:lineage:{L}:state` (absent = live; `default` is always live and has none).
The Task start and the Training Run claim read it inside their own transactions (`require_live`, which WATCHes it),
so a lineage archived or marked for deletion meanwhile fails their EXEC and they see the new state on the retry:
no Task starts and no run claims on a lineage that is not live.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson
from redis.asyncio.client import Pipeline

from ..common.lineage import DEFAULT_LINEAGE
from .errors import Conflict
from .store import keys


class LineageStatus(StrEnum):
    LIVE = "live"
    ARCHIVED = "archived"
    DELETING = "deleting"


@dataclass(frozen=True, slots=True)
class LineageState:
    """A lineage that is not live. `by`: `operator` or `idle` (the idle sweep). `restore`: the line's active version
    when it was archived (`{"lora_name", "lora_path"}`; None: it served base), activated again by a restore.
    `remove_files`: a deletion that also removes the repository's files."""

    status: LineageStatus
    at: str
    by: str = "operator"
    restore: dict[str, str] | None = None
    remove_files: bool = False

    def to_json(self) -> bytes:
        record: dict[str, Any] = {"state": self.status.value, "at": self.at, "by": self.by}
        if self.status is LineageStatus.ARCHIVED:
            record["restore"] = self.restore
        else:
            record["remove_files"] = self.remove_files
        return orjson.dumps(record)

    def public(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.status.value}
        if self.status is LineageStatus.ARCHIVED:
            out.update(archived_at=self.at, archived_by=self.by,
                       restores_to=(self.restore or {}).get("lora_name", "base"))
        else:
            out.update(deletion_started_at=self.at, remove_files=self.remove_files)
        return out


def parse_state(raw: bytes | str | None) -> LineageState | None:
    """The state a stored value says; None (live) only when nothing is stored. A value this code did not write
    reads as archived: the guard fails closed (no Task, no run) until an operator restores or deletes it."""
    if raw is None:
        return None
    try:
        record = orjson.loads(raw)
        status = LineageStatus(record["state"])
        restore = record.get("restore")
        if status is LineageStatus.LIVE or (restore is not None and not (
                isinstance(restore, dict) and all(isinstance(restore.get(f), str) for f in ("lora_name", "lora_path")))):
            raise ValueError("not a stored state")
        return LineageState(status, str(record.get("at") or ""), str(record.get("by") or "operator"),
                            restore, bool(record.get("remove_files", False)))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return LineageState(LineageStatus.ARCHIVED, "", "unknown")


def not_live(lineage: str, state: LineageState) -> Conflict:
    if state.status is LineageStatus.DELETING:
        return Conflict(f"lineage {lineage!r} is being deleted", code="lineage_deleting")
    return Conflict(f"lineage {lineage!r} is archived: an operator restores it (rl lineage restore {lineage})",
                    code="lineage_archived")


async def require_live(pipe: Pipeline, lineage: str) -> None:
    """Inside a caller's optimistic transaction (before its MULTI): WATCH the lineage's state and raise Conflict
    `lineage_archived` / `lineage_deleting` unless it is live, so the caller's EXEC fails if it changes after."""
    if lineage == DEFAULT_LINEAGE:
        return  # always live: nothing to read, nothing to WATCH
    key = keys.lineage_state(lineage)
    await pipe.watch(key)
    state = parse_state(await pipe.get(key))
    if state is not None:
        raise not_live(lineage, state)
