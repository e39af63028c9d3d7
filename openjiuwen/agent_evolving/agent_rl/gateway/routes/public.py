"""Unsigned routes: gateway health, Prometheus metrics, and the inference proxy (OpenAI and Anthropic shapes)."""

from __future__ import annotations

import logging

import httpx
from fastapi import APIRouter, Request
from starlette.responses import Response

from ...common.http_metrics import CONTENT_TYPE
from ..responses import json_response
from .deps import GatewayDep

log = logging.getLogger("openjiuwen.agent_rl.gateway")

RL_SCRAPE_TIMEOUT_S = 5.0

router = APIRouter()


@router.get("/aigw/v1/health")
async def health(gw: GatewayDep) -> Response:
    return json_response({"status": "ok" if gw.ready else "starting", "rl_service": gw.supervisor.status()["status"]})


@router.get("/metrics")
async def metrics(gw: GatewayDep) -> Response:
    """Unsigned (CONTRACT §3.2): the gateway's `gw_*` series, then the RL Service child's `rl_*` series while it runs
    (its own /metrics sits behind the child's random bearer token on loopback)."""
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


@router.post("/v1/chat/completions")
async def chat(request: Request, gw: GatewayDep) -> Response:
    return await gw.inference.chat(request)


@router.post("/v1/messages")
async def messages(request: Request, gw: GatewayDep) -> Response:
    return await gw.inference.messages(request)
