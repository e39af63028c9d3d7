"""HMAC-signed RL control (CONTRACT §3.3): the service, Task start and stop (pinning, drain), and the RL Service's
public routes proxied as they are.

Operator routes take the api key only. Agent routes (Task start, stop and reward; rail uploads) take the api key or
an agent key; for an agent key the RL Service is told which key calls, and answers a Task started with another key
as unknown. An agent key limited to lineages gets 403 `lineage_forbidden` on Task start, stop and reward outside them."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from ...common.wire import routes as rl_routes
from .deps import AgentSigned, GatewayDep, SignedBody, agent_signed, api_signed_body

operator_router = APIRouter(dependencies=[Depends(api_signed_body)])
agent_router = APIRouter(dependencies=[Depends(agent_signed)])

# Proxied to the RL Service unchanged (method, encoded path, query, signed body), as common/wire/routes.py flags
# them: operator key only, or (agent) the operator key or an agent key, named to the RL Service.
PROXIED_ROUTES = tuple((r.method, r.path) for r in rl_routes.proxied(rl_routes.Gateway.OPERATOR))
AGENT_PROXIED_ROUTES = tuple((r.method, r.path) for r in rl_routes.proxied(rl_routes.Gateway.AGENT))


@operator_router.post(rl_routes.SERVICE_START.path)
async def service_start(gw: GatewayDep) -> Response:
    return await gw.control.service_start()


@operator_router.post(rl_routes.SERVICE_STOP.path)
async def service_stop(gw: GatewayDep) -> Response:
    return await gw.control.service_stop()


@operator_router.get(rl_routes.SERVICE_STATUS.path)
async def service_status(gw: GatewayDep) -> Response:
    return gw.control.service_status()


@agent_router.post(rl_routes.TASK_START.path)
async def task_start(request: Request, signed: AgentSigned, gw: GatewayDep) -> Response:
    return await gw.control.task_start(request, signed.body, agent_key=signed.caller.agent_key_id)


@agent_router.post(rl_routes.TASK_STOP.path)
async def task_stop(rl_task_id: str, signed: AgentSigned, gw: GatewayDep) -> Response:
    return await gw.control.task_stop(rl_task_id, signed.body, agent_key=signed.caller.agent_key_id)


@agent_router.post(rl_routes.TASK_REWARD.path)
async def task_reward(rl_task_id: str, request: Request, signed: AgentSigned, gw: GatewayDep) -> Response:
    """Proxied as it came, once the agent key's lineage limit allows the Task (docs/lineages.md)."""
    return await gw.control.task_reward(rl_task_id, raw_path(request), signed.body, query=request.url.query,
                                        agent_key=signed.caller.agent_key_id)


async def proxied(request: Request, body: SignedBody, gw: GatewayDep) -> Response:
    return await gw.control.forward(request.method, raw_path(request), body=body, query=request.url.query)


async def agent_proxied(request: Request, signed: AgentSigned, gw: GatewayDep) -> Response:
    """The rail upload: rail samples train the default line, so a key limited to other lineages is refused."""
    return await gw.control.rail_upload(raw_path(request), signed.body, query=request.url.query,
                                        agent_key=signed.caller.agent_key_id)


for _method, _path in PROXIED_ROUTES:
    operator_router.add_api_route(_path, proxied, methods=[_method])
for _method, _path in AGENT_PROXIED_ROUTES:
    agent_router.add_api_route(_path, agent_proxied, methods=[_method])

router = APIRouter()
router.include_router(operator_router)
router.include_router(agent_router)


def raw_path(request: Request) -> str:
    """The path as the client encoded it. Forwarding the decoded path would turn an escaped `?`, `#` or control
    character inside an id into a query, a fragment or an invalid URL on the way to the RL Service."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    return quote(raw, safe="/%:@!$&'()*+,;=-._~")  # escapes kept as they are; anything else escaped
