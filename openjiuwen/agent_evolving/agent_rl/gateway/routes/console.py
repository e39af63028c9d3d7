"""The read-only web console under `/console` (console/console.py: login token → session cookie, then read-only
views)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from .deps import GatewayDep

router = APIRouter(prefix="/console")


@router.get("")
async def bare() -> Response:
    return Response(status_code=308, headers={"location": "/console/"})  # the assets' relative paths need the /


@router.get("/")
async def page(request: Request, gw: GatewayDep) -> Response:
    return gw.console.page(request)


@router.get("/login")
async def login_page(gw: GatewayDep) -> Response:
    return gw.console.login_page()


@router.post("/login")
async def login(request: Request, gw: GatewayDep) -> Response:
    return await gw.console.login(request)


@router.post("/logout")
async def logout(gw: GatewayDep) -> Response:
    return gw.console.logout()


@router.get("/assets/{name}")
async def asset(name: str, gw: GatewayDep) -> Response:
    return gw.console.asset(name)


@router.get("/api/overview")
async def overview(request: Request, gw: GatewayDep) -> Response:
    return await gw.console.overview(request)


@router.get("/api/lineages")
async def lineages(request: Request, gw: GatewayDep) -> Response:
    return await gw.console.lineages(request)


@router.get("/api/loras/{line}")
async def lora(line: str, request: Request, gw: GatewayDep) -> Response:
    return gw.console.lora(request, line)


@router.get("/api/rl/{path:path}")
async def rl_read(path: str, request: Request, gw: GatewayDep) -> Response:
    return await gw.console.rl_read(request, path)
