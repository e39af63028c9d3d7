"""The reference gateway app: the one place that builds and wires every gateway part (CONTRACT §3).

Route families: unsigned inference (`/v1/chat/completions`, `/v1/messages`) and health; HMAC-signed control
(service, Tasks, Training Runs, trajectories, rail upload, LoRA status/delete, instance registration); loopback-only
internal LoRA routes for the RL Service child, checked against its bearer token.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ..online.api.errors import CatchAllMiddleware
from .config import GatewayConfig
from .control import RLControl
from .hmac_auth import HmacVerifier
from .http11 import Http11Client
from .inference import InferenceProxy
from .instances import Instance, InstanceRegistry
from .lora_manager import LoraError, LoraManager
from .responses import envelope, json_response
from .rl_client import RLClient
from .sessions import SessionMap
from .supervisor import RLSupervisor
from .tasks import TaskTracker

log = logging.getLogger("openjiuwen.agent_rl.gateway")

RETRY_FAILED_INSTANCES_S = 30.0
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@dataclass
class Gateway:
    config: GatewayConfig
    model_id: str
    verifier: HmacVerifier
    loras: LoraManager
    supervisor: RLSupervisor
    rl: RLClient
    tracker: TaskTracker
    control: RLControl
    inference: InferenceProxy
    upstream: Http11Client
    ready: bool = False


def build_gateway(config: GatewayConfig, *, model_id: str, verifier: HmacVerifier, env: dict[str, str]) -> Gateway:
    registry = InstanceRegistry(
        [Instance(i.name, i.model, i.instance_ip, int(i.port)) for i in config.instances]
    )
    # Idle upstream connections close before vLLM's keep-alive timeout (5 s) could race a new request on them.
    upstream = Http11Client(keepalive_expiry_s=2.0, connect_timeout_s=10.0, max_idle_per_origin=256)
    loras = LoraManager(
        registry, lora_root=config.lora.root, state_path=config.lora.state_path,
        operation_timeout_s=config.lora.operation_timeout_s,
    )
    online = config.online_rl
    holder: dict[str, RLControl] = {}

    async def on_exit(reason: str) -> None:
        await holder["control"].on_child_exit(reason)

    supervisor = RLSupervisor(
        command=list(online.command), config_path=online.config_path, endpoint=online.endpoint,
        control_timeout_s=online.control_timeout_s, env=env, on_exit=on_exit,
        # The child's own output (a crash before its log file is set up) lands beside the gateway's LoRA state.
        log_dir=Path(config.lora.state_path).parent,
    )
    rl = RLClient(
        endpoint=online.endpoint, token=lambda: supervisor.token, hook_timeout_s=online.hook_timeout_s,
        hook_retries=online.hook_retries, control_timeout_s=online.control_timeout_s,
    )
    tracker = TaskTracker(SessionMap(), loras)
    control = RLControl(
        model_id=model_id, supervisor=supervisor, rl=rl, tracker=tracker, loras=loras,
        drain_timeout_s=online.drain_timeout_s,
    )
    holder["control"] = control
    inference = InferenceProxy(
        model_id=model_id, tracker=tracker, loras=loras, rl=rl, rl_running=control.running, upstream=upstream,
    )
    return Gateway(config, model_id, verifier, loras, supervisor, rl, tracker, control, inference, upstream)


def create_gateway_app(gw: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.loras.restore()
        gw.ready = True
        retry = asyncio.create_task(_retry_failed_forever(gw), name="lora-retry")
        log.info("gateway ready for model %s", gw.model_id)
        try:
            yield
        finally:
            gw.ready = False
            retry.cancel()
            await asyncio.gather(retry, return_exceptions=True)
            await gw.supervisor.close()
            await gw.inference.close()
            await gw.loras.close()
            await gw.rl.aclose()
            await gw.upstream.aclose()

    app = FastAPI(title="openjiuwen online RL gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)
    app.state.gateway = gw

    async def signed(request: Request, *, allow_ins: bool = False) -> bytes | Response:
        body = await request.body()
        ok = gw.verifier.verify(
            request.headers.get("x-timestamp"), body, request.headers.get("x-signature"),
            now_ms=int(time.time() * 1000), allow_ins=allow_ins,
        )
        if not ok:
            return envelope(401, "invalid_signature", "missing, invalid, stale or replayed signature")
        return body

    def internal_allowed(request: Request) -> Response | None:
        host = request.client.host if request.client else ""
        if host not in _LOOPBACK:
            return envelope(403, "forbidden", "internal routes are served to loopback only")
        token = gw.supervisor.token
        if token:
            presented = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(presented, f"Bearer {token}".encode()):
                return envelope(401, "unauthorized", "missing or invalid bearer token")
        return None

    # ---------------------------------------------------------------- unsigned

    @app.get("/aigw/v1/health")
    async def health() -> Response:
        return json_response({"status": "ok" if gw.ready else "starting", "rl_service": gw.supervisor.status()["status"]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await gw.inference.chat(request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await gw.inference.messages(request)

    # ---------------------------------------------------------------- service

    @app.post("/v1/rl/service/start")
    async def service_start(request: Request) -> Response:
        body = await signed(request)
        return body if isinstance(body, Response) else await gw.control.service_start()

    @app.post("/v1/rl/service/stop")
    async def service_stop(request: Request) -> Response:
        body = await signed(request)
        return body if isinstance(body, Response) else await gw.control.service_stop()

    @app.get("/v1/rl/service")
    async def service_status(request: Request) -> Response:
        body = await signed(request)
        return body if isinstance(body, Response) else gw.control.service_status()

    # ---------------------------------------------------------------- tasks and runs

    @app.post("/v1/rl/tasks/start")
    async def task_start(request: Request) -> Response:
        body = await signed(request)
        return body if isinstance(body, Response) else await gw.control.task_start(request, body)

    @app.post("/v1/rl/tasks/{rl_task_id}/stop")
    async def task_stop(rl_task_id: str, request: Request) -> Response:
        body = await signed(request)
        return body if isinstance(body, Response) else await gw.control.task_stop(rl_task_id, body)

    async def proxied(request: Request) -> Response:
        body = await signed(request)
        if isinstance(body, Response):
            return body
        return await gw.control.forward(request.method, request.url.path, body=body, query=request.url.query)

    for method, path in (
        ("GET", "/v1/rl/tasks/{rl_task_id}"),
        ("POST", "/v1/rl/tasks/{rl_task_id}/reward"),
        ("GET", "/v1/rl/tasks/{rl_task_id}/events"),
        ("POST", "/v1/rl/training/runs"),
        ("GET", "/v1/rl/training/runs/{training_run_id}"),
        ("POST", "/v1/rl/training/runs/{training_run_id}/stop"),
        ("GET", "/v1/rl/training/runs/{training_run_id}/events"),
        ("GET", "/v1/rl/trajectories/stats"),
        ("GET", "/v1/rl/trajectories"),
        ("GET", "/v1/rl/trajectories/{trajectory_id}"),
        ("POST", "/v1/gateway/upload/batch"),
    ):
        app.add_api_route(path, proxied, methods=[method])

    # ---------------------------------------------------------------- LoRA and instances

    @app.get("/v1/loras/{model}")
    async def lora_status(model: str, request: Request) -> Response:
        body = await signed(request)
        return body if isinstance(body, Response) else json_response(await gw.loras.refresh_status(model))

    @app.delete("/v1/loras/{model}")
    async def lora_delete(model: str, request: Request) -> Response:
        body = await signed(request)
        if isinstance(body, Response):
            return body
        try:
            await gw.loras.deactivate(model)
        except LoraError as exc:
            return envelope(exc.status, exc.code, exc.message)
        return Response(status_code=204)

    @app.post("/aigw/v1/register-instance")
    async def register_instance(request: Request) -> Response:
        body = await signed(request, allow_ins=True)
        if isinstance(body, Response):
            return body
        if not gw.ready:
            return envelope(503, "not_ready", "the gateway is starting; retry")
        try:
            data = orjson.loads(body)
            name, model, host, port = data["name"], data["model"], data["instanceIp"], int(data["port"])
            if not all(isinstance(v, str) and v for v in (name, model, host)):
                raise ValueError("name, model and instanceIp must be non-empty strings")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return envelope(400, "invalid_request", f"invalid registration: {exc}")
        await gw.loras.register_instance(name, model, host, port)
        return json_response({"status": "registered", "name": name})

    # ---------------------------------------------------------------- internal (RL Service → gateway)

    @app.get("/internal/v1/rl/loras/{model}")
    async def internal_lora_status(model: str, request: Request) -> Response:
        refused = internal_allowed(request)
        return refused or json_response(await gw.loras.refresh_status(model))

    @app.post("/internal/v1/rl/loras/activate")
    async def internal_activate(request: Request) -> Response:
        refused = internal_allowed(request)
        if refused:
            return refused
        try:
            data = orjson.loads(await request.body())
            args = {k: data[k] for k in ("base_model", "lora_name", "lora_path", "expected_lora_name")}
            if not all(isinstance(v, str) for v in args.values()):
                raise TypeError("fields must be strings")
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            return envelope(400, "invalid_lora_request", f"invalid activation request: {exc}")
        try:
            return json_response(await gw.loras.activate(**args))
        except LoraError as exc:
            return envelope(exc.status, exc.code, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def framework_error(_: Request, exc: StarletteHTTPException) -> Response:
        return envelope(exc.status_code, "request_failed", str(exc.detail))

    app.add_middleware(CatchAllMiddleware, message="internal gateway error", logger=log)

    return app


async def _retry_failed_forever(gw: Gateway) -> None:
    while True:
        await asyncio.sleep(RETRY_FAILED_INSTANCES_S)
        try:
            await gw.loras.retry_failed()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("retrying failed LoRA loads failed")
