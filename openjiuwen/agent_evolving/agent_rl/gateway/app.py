"""The reference gateway app: the one place that builds and wires every gateway part (CONTRACT §3).

Route families: unsigned inference (`/v1/chat/completions`, `/v1/messages`) and health; HMAC-signed control
(service, Tasks, Training Runs, trajectories, rail upload, LoRA status/delete, instance registration with the api or
the instance key, instance removal and listing with the api key only); loopback-only internal LoRA routes for the RL
Service child, checked against its bearer token and closed while no child is alive; the read-only web console under
`/console` (a login token signed with the api key, exchanged for a session cookie; see console.py). Every route takes
a JSON body or none (415 otherwise, before any route runs).
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
from urllib.parse import quote

import httpx
import orjson
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ..common.content_type import JsonBodyMiddleware
from ..common.errors import CatchAllMiddleware, PayloadTooLarge
from ..common.guards import GuardMiddleware
from ..common.http_metrics import CONTENT_TYPE, HttpMetricsMiddleware
from .config import GatewayConfig
from .console import Console
from .console_auth import ConsoleAuth
from .control import RLControl
from .health import HealthMonitor
from .hmac_auth import HmacVerifier
from .http11 import Http11Client
from .inference import InferenceProxy
from .instances import Instance, InstanceRegistry
from .lora_manager import LoraError, LoraManager
from .metrics import GatewayMetrics
from .responses import envelope, json_response
from .rl_client import RLClient
from .security_headers import SecurityHeadersMiddleware
from .sessions import SessionMap
from .supervisor import RLSupervisor
from .tasks import TaskTracker

log = logging.getLogger("openjiuwen.agent_rl.gateway")

RETRY_FAILED_INSTANCES_S = 30.0
RL_SCRAPE_TIMEOUT_S = 5.0
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
    registry: InstanceRegistry
    metrics: GatewayMetrics
    console: Console
    health: HealthMonitor
    ready: bool = False


def build_gateway(
    config: GatewayConfig, *, verifier: HmacVerifier, console_auth: ConsoleAuth, env: dict[str, str]
) -> Gateway:
    online = config.online_rl
    model_id = online.model_id  # the gateway's own setting, checked against the child's /health
    metrics = GatewayMetrics()  # per app: its own CollectorRegistry
    registry = InstanceRegistry(
        [Instance(i.name, i.model, i.instance_ip, int(i.port)) for i in config.instances],
        max_registered=config.registration.max_instances,
    )
    # Idle upstream connections close before vLLM's keep-alive timeout (5 s) could race a new request on them.
    upstream = Http11Client(keepalive_expiry_s=2.0, connect_timeout_s=10.0, max_idle_per_origin=256)
    checks = config.instance_health
    health = HealthMonitor(
        # `loras` is bound below, before the first check runs (in the lifespan).
        registry, readmit=lambda instance: loras.readmit(instance), interval_s=checks.interval_s,
        timeout_s=checks.timeout_s, failure_threshold=checks.failure_threshold,
    )
    loras = LoraManager(
        registry, lora_root=config.lora.root, state_path=config.lora.state_path,
        operation_timeout_s=config.lora.operation_timeout_s, probe=health.probe,
    )
    holder: dict[str, RLControl] = {}

    async def on_exit(reason: str) -> None:
        await holder["control"].on_child_exit(reason)

    supervisor = RLSupervisor(
        command=list(online.command), config_path=online.config_path, endpoint=online.endpoint,
        control_timeout_s=online.control_timeout_s, env=env, on_exit=on_exit, model_id=online.model_id,
        # The child's own output (a crash before its log file is set up) lands beside the gateway's LoRA state.
        log_dir=Path(config.lora.state_path).parent,
    )
    rl = RLClient(
        endpoint=online.endpoint, token=lambda: supervisor.token, hook_timeout_s=online.hook_timeout_s,
        hook_retries=online.hook_retries, control_timeout_s=online.control_timeout_s, metrics=metrics,
    )
    tracker = TaskTracker(SessionMap(), loras)
    control = RLControl(
        model_id=model_id, supervisor=supervisor, rl=rl, tracker=tracker, loras=loras,
        drain_timeout_s=online.drain_timeout_s,
    )
    holder["control"] = control
    inference = InferenceProxy(
        model_id=model_id, tracker=tracker, loras=loras, rl=rl, rl_running=control.running, upstream=upstream,
        metrics=metrics,
    )
    console = Console(auth=console_auth, control=control, loras=loras, supervisor=supervisor, model_id=model_id)
    return Gateway(
        config, model_id, verifier, loras, supervisor, rl, tracker, control, inference, upstream, registry, metrics,
        console, health,
    )


def create_gateway_app(gw: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.health.check_once(at_start=True)  # a static instance down at start stays out of restore and routing
        await gw.loras.restore()
        gw.ready = True
        retry = asyncio.create_task(_retry_failed_forever(gw), name="lora-retry")
        checks = asyncio.create_task(gw.health.run(), name="instance-health")
        log.info("gateway ready for model %s", gw.model_id)
        try:
            yield
        finally:
            gw.ready = False
            retry.cancel()
            checks.cancel()
            await asyncio.gather(retry, checks, return_exceptions=True)
            await gw.supervisor.close()
            await gw.inference.close()
            await gw.loras.close()
            await gw.health.close()
            await gw.rl.aclose()
            await gw.upstream.aclose()

    app = FastAPI(title="openjiuwen online RL gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)
    app.state.gateway = gw

    async def signed(request: Request, *, allow_ins: bool = False) -> bytes | Response:
        body = await request.body()
        ok = gw.verifier.verify_request(
            request.method, _request_target(request), request.headers, body,
            now_ms=int(time.time() * 1000), allow_ins=allow_ins,
        )
        if not ok:
            return envelope(401, "invalid_signature", "missing, invalid, stale or replayed signature")
        return body

    def internal_allowed(request: Request) -> Response | None:
        host = request.client.host if request.client else ""
        if host not in _LOOPBACK:
            return envelope(403, "forbidden", "internal routes are served to loopback only")
        # Fail closed: with no RL Service child alive there is no token, and nobody may use these routes.
        token = gw.supervisor.internal_token
        if not token:
            return envelope(401, "unauthorized", "no RL Service child is running; internal routes are closed")
        presented = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(presented, f"Bearer {token}".encode()):
            return envelope(401, "unauthorized", "missing or invalid bearer token")
        return None

    # ---------------------------------------------------------------- unsigned

    @app.get("/aigw/v1/health")
    async def health() -> Response:
        return json_response({"status": "ok" if gw.ready else "starting", "rl_service": gw.supervisor.status()["status"]})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Unsigned (CONTRACT §3.2): the gateway's `gw_*` series, then the RL Service child's `rl_*` series while it
        runs (its own /metrics sits behind the child's random bearer token on loopback)."""
        running = gw.control.running()
        gw.metrics.refresh(loras=gw.loras, instances=gw.registry, sessions=gw.tracker.sessions,
                           model_id=gw.model_id, rl_running=running)
        child = b""
        if running:
            try:
                child = await gw.rl.metrics_text(RL_SCRAPE_TIMEOUT_S)
            except httpx.HTTPError as exc:
                gw.metrics.rl_scrape_errors.inc()
                log.warning("could not read the RL Service metrics: %s", type(exc).__name__)
        return Response(gw.metrics.render() + child, media_type=CONTENT_TYPE)

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
        return await gw.control.forward(request.method, _raw_path(request), body=body, query=request.url.query)

    for method, path in (
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
        try:
            serving = await gw.loras.register_instance(name, model, host, port)
        except LoraError as exc:  # a bad port, a name taken, the cap reached: the client's mistake, never a 500
            return envelope(exc.status, exc.code, exc.message)
        return json_response({"status": "registered", "name": name, "serving": serving})

    @app.post("/aigw/v1/unregister-instance")
    async def unregister_instance(request: Request) -> Response:
        """Operator only (the api key; the instance key is refused): remove a registered instance. The name travels
        in the signed body, so a captured signature cannot be pointed at another instance."""
        body = await signed(request)
        if isinstance(body, Response):
            return body
        try:
            data = orjson.loads(body)
            name = data["name"]
            if not isinstance(name, str) or not name:
                raise ValueError("name must be a non-empty string")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return envelope(400, "invalid_request", f"invalid removal: {exc}")
        try:
            gw.loras.remove_instance(name)
        except LoraError as exc:
            return envelope(exc.status, exc.code, exc.message)
        return json_response({"status": "removed", "name": name})

    @app.get("/aigw/v1/instances")
    async def list_instances(request: Request) -> Response:
        body = await signed(request)
        if isinstance(body, Response):
            return body
        return json_response({"items": gw.loras.instances(), "registered": gw.registry.registered_count(),
                              "max_registered": gw.registry.max_registered})

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

    # Canary (docs/rollout.md; CONTRACT §3.8 ext): a candidate beside the active version, CAS like activation.

    @app.get("/internal/v1/rl/canary/{model}")
    async def internal_canary_status(model: str, request: Request) -> Response:
        refused = internal_allowed(request)
        return refused or json_response(gw.loras.canary_status(model))

    async def canary_call(request: Request, fields: tuple[str, ...], operation: Any) -> Response:
        refused = internal_allowed(request)
        if refused:
            return refused
        try:
            data = orjson.loads(await request.body())
            args = {k: data[k] for k in fields}
            if not all(isinstance(v, str) for k, v in args.items() if k != "share"):
                raise TypeError("fields must be strings")
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            return envelope(400, "invalid_lora_request", f"invalid canary request: {exc}")
        try:
            return json_response(await operation(**args))
        except LoraError as exc:
            return envelope(exc.status, exc.code, exc.message)

    @app.post("/internal/v1/rl/canary/start")
    async def internal_canary_start(request: Request) -> Response:
        return await canary_call(request, ("base_model", "lora_name", "lora_path", "expected_lora_name", "share"),
                                 gw.loras.start_canary)

    @app.post("/internal/v1/rl/canary/promote")
    async def internal_canary_promote(request: Request) -> Response:
        return await canary_call(request, ("base_model", "lora_name", "expected_lora_name"), gw.loras.promote_canary)

    @app.post("/internal/v1/rl/canary/abort")
    async def internal_canary_abort(request: Request) -> Response:
        return await canary_call(request, ("base_model", "lora_name"), gw.loras.abort_canary)

    # ---------------------------------------------------------------- web console (session cookie, read-only)

    @app.get("/console")
    async def console_bare() -> Response:
        return Response(status_code=308, headers={"location": "/console/"})  # the assets' relative paths need the /

    @app.get("/console/")
    async def console_page(request: Request) -> Response:
        return gw.console.page(request)

    @app.get("/console/login")
    async def console_login_page() -> Response:
        return gw.console.login_page()

    @app.post("/console/login")
    async def console_login(request: Request) -> Response:
        return await gw.console.login(request)

    @app.post("/console/logout")
    async def console_logout() -> Response:
        return gw.console.logout()

    @app.get("/console/assets/{name}")
    async def console_asset(name: str) -> Response:
        return gw.console.asset(name)

    @app.get("/console/api/overview")
    async def console_overview(request: Request) -> Response:
        return await gw.console.overview(request)

    @app.get("/console/api/rl/{path:path}")
    async def console_rl(path: str, request: Request) -> Response:
        return await gw.console.rl_read(request, path)

    @app.exception_handler(StarletteHTTPException)
    async def framework_error(_: Request, exc: StarletteHTTPException) -> Response:
        return envelope(exc.status_code, "request_failed", str(exc.detail))

    @app.exception_handler(PayloadTooLarge)  # a chunked body read inside a route went past the limit
    async def too_large(_: Request, exc: PayloadTooLarge) -> Response:
        return envelope(413, "payload_too_large", str(exc))

    # Every route takes JSON or nothing: other bodies get 415 before any route (or signature check) sees them.
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(CatchAllMiddleware, message="internal gateway error", logger=log)
    # The size is decided from Content-Length before anything is read (no bearer token at this layer).
    app.add_middleware(GuardMiddleware, token=None, max_body_bytes=gw.config.global_.max_body_bytes,
                       loopback_only=False)
    app.add_middleware(HttpMetricsMiddleware, observe=gw.metrics.http)  # every answer is counted
    # Outermost: nosniff and a deny-all CSP on every answer, the 413 and 500 envelopes of the layers above included.
    app.add_middleware(SecurityHeadersMiddleware)

    return app


def _request_target(request: Request) -> bytes:
    """The request target as it arrived (percent-encoded path, then `?query` when there is one): what a version-2
    signature covers."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string") or b""
    return raw + b"?" + query if query else raw


def _raw_path(request: Request) -> str:
    """The path as the client encoded it. Forwarding the decoded path would turn an escaped `?`, `#` or control
    character inside an id into a query, a fragment or an invalid URL on the way to the RL Service."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    return quote(raw, safe="/%:@!$&'()*+,;=-._~")  # escapes kept as they are; anything else escaped


async def _retry_failed_forever(gw: Gateway) -> None:
    while True:
        await asyncio.sleep(RETRY_FAILED_INSTANCES_S)
        try:
            await gw.loras.retry_failed()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("retrying failed LoRA loads failed")
