"""HMAC-signed RL control (CONTRACT §3.3): the service, Task start and stop (pinning, drain), and the RL Service's
public routes proxied as they are."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from .deps import GatewayDep, SignedBody, api_signed_body

router = APIRouter(dependencies=[Depends(api_signed_body)])

# Proxied to the RL Service unchanged (method, encoded path, query, signed body).
PROXIED_ROUTES = (
    ("GET", "/v1/rl/tasks"),
    ("GET", "/v1/rl/tasks/{rl_task_id}"),
    ("POST", "/v1/rl/tasks/{rl_task_id}/reward"),
    ("GET", "/v1/rl/tasks/{rl_task_id}/events"),
    ("GET", "/v1/rl/training/runs"),
    ("POST", "/v1/rl/training/runs"),
    ("GET", "/v1/rl/training/runs/{training_run_id}"),
    ("POST", "/v1/rl/training/runs/{training_run_id}/stop"),
    ("GET", "/v1/rl/training/runs/{training_run_id}/events"),
    ("GET", "/v1/rl/trajectories/stats"),
    ("GET", "/v1/rl/trajectories"),
    ("GET", "/v1/rl/trajectories/{trajectory_id}"),
    ("POST", "/v1/rl/trajectories/exclude"),
    ("POST", "/v1/rl/trajectories/rewards"),
    ("POST", "/v1/rl/trajectories/{trajectory_id}/rewards"),
    ("GET", "/v1/rl/policies"),
    ("GET", "/v1/rl/rollout"),
    ("POST", "/v1/rl/rollout/promote"),
    ("POST", "/v1/rl/rollout/rollback"),
    ("POST", "/v1/rl/rollout/pause"),
    ("POST", "/v1/rl/rollout/resume"),
    ("GET", "/v1/rl/rollout/{rollout_id}/events"),
    ("POST", "/v1/rl/loras/activate"),
    ("POST", "/v1/gateway/upload/batch"),
)


@router.post("/v1/rl/service/start")
async def service_start(gw: GatewayDep) -> Response:
    return await gw.control.service_start()


@router.post("/v1/rl/service/stop")
async def service_stop(gw: GatewayDep) -> Response:
    return await gw.control.service_stop()


@router.get("/v1/rl/service")
async def service_status(gw: GatewayDep) -> Response:
    return gw.control.service_status()


@router.post("/v1/rl/tasks/start")
async def task_start(request: Request, body: SignedBody, gw: GatewayDep) -> Response:
    return await gw.control.task_start(request, body)


@router.post("/v1/rl/tasks/{rl_task_id}/stop")
async def task_stop(rl_task_id: str, body: SignedBody, gw: GatewayDep) -> Response:
    return await gw.control.task_stop(rl_task_id, body)


async def proxied(request: Request, body: SignedBody, gw: GatewayDep) -> Response:
    return await gw.control.forward(request.method, raw_path(request), body=body, query=request.url.query)


for _method, _path in PROXIED_ROUTES:
    router.add_api_route(_path, proxied, methods=[_method])


def raw_path(request: Request) -> str:
    """The path as the client encoded it. Forwarding the decoded path would turn an escaped `?`, `#` or control
    character inside an id into a query, a fragment or an invalid URL on the way to the RL Service."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    return quote(raw, safe="/%:@!$&'()*+,;=-._~")  # escapes kept as they are; anything else escaped
