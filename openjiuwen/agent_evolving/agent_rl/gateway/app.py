"""The reference gateway's FastAPI app (CONTRACT §3): the routers, the lifespan of the parts, domain errors mapped
onto the envelope in one place, and the middleware stack.

Route families (routes/): unsigned inference (`/v1/chat/completions`, `/v1/messages`), health and metrics;
HMAC-signed control (service, Tasks, Training Runs, trajectories, rail upload, LoRA status/delete, instance
registration with the api or the instance key, instance removal and listing with the api key only); loopback-only
internal LoRA and canary routes for the RL Service child, checked against its bearer token and closed while no child
is alive; the read-only web console under `/console` (a login token signed with the api key, exchanged for a session
cookie; see console/console.py). Every route takes a JSON body or none (415 otherwise, before any route runs).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import Response

from ..common.content_type import JsonBodyMiddleware
from ..common.errors import install_error_envelope
from ..common.http_metrics import HttpMetricsMiddleware
from ..common.request_guards import GuardMiddleware
from .assembly import Gateway, build_gateway
from .domain_errors import error_answer
from .lora.lora_manager import LoraError
from .routes import console, control, internal, lora, public
from .security_headers import SecurityHeadersMiddleware

__all__ = ["Gateway", "build_gateway", "create_gateway_app"]

log = logging.getLogger("openjiuwen.agent_rl.gateway")

RETRY_FAILED_INSTANCES_S = 30.0


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
            await gw.control.close()
            await gw.supervisor.close()
            await gw.inference.close()
            await gw.loras.close()
            await gw.health.close()
            await gw.rl.aclose()
            await gw.upstream.aclose()

    app = FastAPI(title="openjiuwen online RL gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)
    app.state.gateway = gw
    for module in (public, control, lora, internal, console):
        app.include_router(module.router)

    @app.exception_handler(LoraError)
    async def lora_error(_: Request, exc: LoraError) -> Response:
        return error_answer(exc)

    # Every route takes JSON or nothing: other bodies get 415 before any route (or signature check) sees them.
    app.add_middleware(JsonBodyMiddleware)
    # ApiError (the routers' guards and parsing), framework errors, a chunked body past the limit, and the catch-all.
    install_error_envelope(app, logger=log, message="internal gateway error")
    # The size is decided from Content-Length before anything is read (no bearer token at this layer).
    app.add_middleware(GuardMiddleware, token=None, max_body_bytes=gw.config.global_.max_body_bytes,
                       loopback_only=False)
    app.add_middleware(HttpMetricsMiddleware, observe=gw.metrics.http)  # every answer is counted
    # Outermost: nosniff and a deny-all CSP on every answer, the 413 and 500 envelopes of the layers above included.
    app.add_middleware(SecurityHeadersMiddleware)
    return app


async def _retry_failed_forever(gw: Gateway) -> None:
    while True:
        await asyncio.sleep(RETRY_FAILED_INSTANCES_S)
        try:
            await gw.loras.retry_failed()
            await gw.control.bound_leases()  # lines no Task start checked since their last switch
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("retrying failed LoRA loads failed")
