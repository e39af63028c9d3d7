"""Who may name a version of a lineage's line outside an RL Task (issue 37 item 1, docs/lineages.md "Private lines").

A lineage's adapter learned from that lineage's traffic (with one lineage per user, that user's), so outside a Task
the versions of a line other than the default one are served only to callers the operator allowed:

- a request signed (signature version 3, common/hmac_signing.py) with the operator key, or with an agent key whose
  `lineages` limit includes the lineage (a key without a limit may use every lineage, as at Task start);
- anyone, for the lineages the operator opened (`lora.openLineages`).

The default line and the base model stay everyone's, as with an AIGW. The decision is taken from the request alone,
before anything looks at which lines or versions exist, and with no I/O: a caller who is not allowed gets the answer
of an unknown model whether or not the lineage or the version exists, at the same cost. The instance key never
counts here."""

from __future__ import annotations

import time
from collections.abc import Mapping

from starlette.requests import Request

from ...common.hmac_signing import SIGNATURE_HEADER
from ...common.lineage import DEFAULT_LINEAGE
from .hmac_auth import HmacVerifier, KeyRole, request_target


class LineageAccess:
    def __init__(self, verifier: HmacVerifier, *, agent_lineages: Mapping[str, frozenset[str]],
                 open_lineages: frozenset[str] = frozenset()) -> None:
        """`agent_lineages`: the limit of each agent key that has one (common/signing_keys.HmacKeys);
        `open_lineages`: lineages whose versions anyone may name outside a Task."""
        self._verifier = verifier
        self._agent_lineages = dict(agent_lineages)
        self._open = frozenset(open_lineages)

    async def allows(self, request: Request, lineage: str) -> bool:
        """Whether the request may name a version of `lineage` outside a Task."""
        if lineage == DEFAULT_LINEAGE or lineage in self._open:
            return True
        if SIGNATURE_HEADER not in request.headers:
            return False
        caller = self._verifier.verify_request(request.method, request_target(request), request.headers,
                                               await request.body(), now_ms=int(time.time() * 1000))
        if caller is None:
            return False
        if caller.role is KeyRole.OPERATOR:
            return True
        if caller.role is KeyRole.AGENT and caller.agent_key_id is not None:
            limit = self._agent_lineages.get(caller.agent_key_id)
            return limit is None or lineage in limit
        return False
