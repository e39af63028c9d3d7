"""Per-version evaluation route (issue 9): `GET /v1/rl/policies`."""

from __future__ import annotations

from fastapi import APIRouter

from ..policies import PolicyReport
from ...common.errors import JSONBody


def build_policies_router(report: PolicyReport) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/rl/policies")
    async def policies() -> JSONBody:
        """Every policy version oldest → newest with its aggregates, and the latest version against its parent."""
        return JSONBody(await report.report())

    return router
