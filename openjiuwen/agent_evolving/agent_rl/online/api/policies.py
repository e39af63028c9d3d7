"""Per-version evaluation route (issue 9): `GET /v1/rl/policies`, optionally one lineage's line (docs/lineages.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...common.wire import routes as rl_routes
from ...common.errors import JSONBody
from ..lineages import LineageRegistry
from ..version_report import PolicyReport
from . import openapi
from .lineages import known_lineage


def build_policies_router(report: PolicyReport, lineages: LineageRegistry) -> APIRouter:
    router = APIRouter()

    @router.get(rl_routes.POLICIES.path, openapi_extra=openapi.POLICY_LIST)
    async def policies(request: Request) -> JSONBody:
        """Every policy version oldest → newest with its aggregates, and the latest version against its parent;
        with `?lineage=`, `base` and that lineage's versions only."""
        lineage = request.query_params.get("lineage")
        if lineage is None:
            return JSONBody(await report.report())
        return JSONBody(await report.report(lineage=await known_lineage(lineages, lineage)))

    return router
