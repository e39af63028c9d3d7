"""rail-v1 upload route (CONTRACT §2.9): `POST /v1/gateway/upload/batch`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ...common.wire import routes as rl_routes
from ..rail_ingest.ingest import RailIngestor
from . import openapi
from .body import json_object
from .errors import domain_errors


def build_rail_router(ingestor: RailIngestor) -> APIRouter:
    router = APIRouter()

    @router.post(rl_routes.RAIL_BATCH.path, openapi_extra=openapi.RAIL_BATCH)
    async def upload_batch(request: Request) -> dict[str, Any]:
        """Stage, judge and store one rail-v1 batch; 400 `invalid_rail_batch` / `judge_not_configured`."""
        body = await json_object(request)
        with domain_errors(not_found="invalid_rail_batch", conflict="invalid_rail_batch"):
            result = await ingestor.ingest(body)
        return {"ok": True, "result": result}

    return router
