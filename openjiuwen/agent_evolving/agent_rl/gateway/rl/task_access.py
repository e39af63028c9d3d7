"""An agent key's lineage limit on Task stop and reward (docs/lineages.md "## Gateway", issue 27 item 4).

Task start refuses a lineage outside the key's limit; stop and reward of a Task are refused the same way, 403
`lineage_forbidden`. The check comes after the own-Task rule and reveals nothing beyond it: a Task another key started
gets whatever the caller got before (404 `task_not_found`, from the gateway or the RL Service), so 403 only ever names
a Task the caller itself started (in a lineage its limit no longer covers, e.g. after the key file changed).

The Task's lineage is the binding's (the lineage its start was forwarded with) while the gateway maps the Task, else
the RL Service's record (`lineage`, absent for `default`): a finished Task can still be rewarded, and a gateway
restart forgets every binding. A lookup that fails refuses the call (fail closed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import httpx
import orjson
from starlette.responses import Response

from ...common.ids import is_task_id
from ...common.lineage import DEFAULT_LINEAGE
from ...common.wire import routes as rl_routes
from ..responses import envelope
from .rl_client import RLAnswer
from .sessions import SessionMap


class TaskReader(Protocol):
    """The RL Service as this guard reads it (RLClient.forward)."""

    async def forward(self, method: str, path: str, *, body: bytes = b"", query: str = "",
                      headers: dict[str, str | bytes] | None = None) -> RLAnswer: ...


class LineageGuard:
    def __init__(self, limits: Mapping[str, frozenset[str]], sessions: SessionMap, rl: TaskReader) -> None:
        """`limits`: agent key id → the lineages it may use (a key absent here: every one)."""
        self._limits = dict(limits)
        self._sessions = sessions
        self._rl = rl

    async def refusal(self, rl_task_id: str, agent_key: str | None) -> Response | None:
        """The answer refusing `agent_key` this Task by its lineage, or None to go on as before."""
        allowed = self._limits.get(agent_key) if agent_key is not None else None
        if allowed is None or not is_task_id(rl_task_id):  # unlimited; a malformed id stays unknown downstream
            return None
        binding = self._sessions.for_task(rl_task_id)
        if binding is not None:
            owner, lineage = binding.agent_key, binding.lineage
        else:
            found = await self._lookup(rl_task_id)
            if isinstance(found, Response):
                return found
            if found is None:
                return None  # unknown: the RL Service answers it as it always did
            owner, lineage = found
        if owner != agent_key:
            return None  # another key's Task: the own-Task rule answers (unknown), not this one
        if lineage in allowed:  # fails closed: an empty limit allows nothing, a malformed record lineage matches none
            return None
        return envelope(403, "lineage_forbidden", f"this agent key may not use Tasks of the lineage {lineage}")

    def rail_refusal(self, agent_key: str | None) -> Response | None:
        """A rail-v1 upload's samples are filed on the default line (the rail contract names no lineage), so a key
        whose limit leaves `default` out may not upload (fails closed: an empty limit allows nothing)."""
        allowed = self._limits.get(agent_key) if agent_key is not None else None
        if allowed is None or DEFAULT_LINEAGE in allowed:
            return None
        return envelope(403, "lineage_forbidden", "rail uploads train the default lineage, which this agent key "
                                                  "may not use")

    async def _lookup(self, rl_task_id: str) -> tuple[str | None, object] | Response | None:
        """(owner key id, lineage) from the RL Service's record; None when unknown; a refusal when unreadable."""
        try:
            answer = await self._rl.forward("GET", rl_routes.TASK.fill(rl_task_id))
        except httpx.TimeoutException:
            return envelope(504, "rl_service_timeout", "the RL Service did not answer in time")
        except httpx.HTTPError as exc:
            return envelope(503, "rl_service_unavailable", f"the RL Service is unreachable: {type(exc).__name__}")
        if answer.status == 404:
            return None
        try:
            record = answer.json() if answer.ok else None
        except orjson.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            return envelope(503, "rl_service_unavailable", "the Task's lineage could not be read from the RL Service")
        return record.get("agent_key_id"), record.get("lineage", DEFAULT_LINEAGE)
