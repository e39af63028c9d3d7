"""Per-router guards: the HMAC signature of control routes (and which keys each route takes) and the loopback +
bearer check of internal routes.

Each guard raises `ApiError` (answered with the envelope by the app's handler) and fails closed: with no RL Service
child alive the internal routes have no token and refuse everyone. A route lists the key roles it takes; a valid
agent-key signature on a route that takes no agent key gets 403 `key_not_permitted` (the instance key is tried on
register-instance only, so elsewhere it is simply an invalid signature)."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from ...common import loopback
from ...common.errors import ApiError
from ...common.lineage import InvalidLineage, split_line
from ..assembly import Gateway
from ..auth.hmac_auth import Caller, KeyRole, request_target


async def gateway_of(request: Request) -> Gateway:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hand-off on every request (it
    # profiled at a tenth of the gateway's CPU on captured completions).
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(gateway_of)]


@dataclass(frozen=True, slots=True)
class Signed:
    """A verified request's body and who signed it."""

    body: bytes
    caller: Caller


async def _verified(request: Request, gw: Gateway, *, roles: frozenset[KeyRole]) -> Signed:
    body = await request.body()
    caller = gw.verifier.verify_request(
        request.method, request_target(request), request.headers, body,
        now_ms=int(time.time() * 1000), allow_ins=KeyRole.INSTANCE in roles,
    )
    if caller is None:
        raise ApiError(401, "invalid_signature", "missing, invalid, stale or replayed signature")
    if caller.role not in roles:  # only an agent key gets here: the others are tried only where they are taken
        raise ApiError(403, "key_not_permitted",
                       f"the agent key {caller.agent_key_id!r} may only start, stop and reward its own Tasks and "
                       "upload rail batches")
    return Signed(body, caller)


_OPERATOR = frozenset({KeyRole.OPERATOR})
_OPERATOR_OR_INSTANCE = frozenset({KeyRole.OPERATOR, KeyRole.INSTANCE})
_OPERATOR_OR_AGENT = frozenset({KeyRole.OPERATOR, KeyRole.AGENT})


async def api_signed_body(request: Request, gw: GatewayDep) -> bytes:
    """The body of a request signed with the api key (operators)."""
    return (await _verified(request, gw, roles=_OPERATOR)).body


async def any_key_signed_body(request: Request, gw: GatewayDep) -> bytes:
    """The body of a request signed with the api key or the instance key (instance self-registration)."""
    return (await _verified(request, gw, roles=_OPERATOR_OR_INSTANCE)).body


async def agent_signed(request: Request, gw: GatewayDep) -> Signed:
    """A request signed with the api key or an agent key (Task start, stop and reward; rail uploads)."""
    return await _verified(request, gw, roles=_OPERATOR_OR_AGENT)


SignedBody = Annotated[bytes, Depends(api_signed_body)]
AgentSigned = Annotated[Signed, Depends(agent_signed)]


async def internal_caller(request: Request, gw: GatewayDep) -> None:
    """Loopback and the bearer token of the RL Service child the gateway spawned, else refused."""
    host = request.client.host if request.client else ""
    if not loopback.is_loopback_ip(host):
        raise ApiError(403, "forbidden", "internal routes are served to loopback only")
    token = gw.supervisor.internal_token
    if not token:
        raise ApiError(401, "unauthorized", "no RL Service child is running; internal routes are closed")
    presented = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(presented, f"Bearer {token}".encode()):
        raise ApiError(401, "unauthorized", "missing or invalid bearer token")


def checked_line(line: str, gw: Gateway) -> str:
    """A line in a route's `{model}` position (docs/lineages.md): 400 `invalid_lineage` when malformed, 404
    `model_not_found` when it is a line of another model than the gateway's."""
    try:
        model, _ = split_line(line)
    except InvalidLineage as exc:
        raise ApiError(400, "invalid_lineage", f"invalid line {line!r}: {exc}") from None
    if model != gw.model_id:
        raise ApiError(404, "model_not_found", f"this gateway serves {gw.model_id}, not {model}")
    return line
