"""The read-only web console served by the gateway: its pages and assets, the login exchange, and `/console/api/...`.

    GET  /console/                 the console page, or the login page without a valid session cookie
    GET  /console/login            the login page; its script posts the token from the URL fragment
    POST /console/login            {"token"} → 204 + session cookie (HttpOnly, SameSite=Strict, Path=/console)
    POST /console/logout           204, cookie cleared
    GET  /console/assets/{name}    the shipped CSS/JS (no secrets in them, so unauthenticated)
    GET  /console/api/overview     service state, LoRA state per instance, trajectory counters
    GET  /console/api/rl/{path}    an allow-listed RL Service read route (Tasks, runs, events, policies, stats)
    GET  /console/api/lineages     the lineage selector's list: `default` first, then the RL Service's
                                   `GET /v1/rl/lineages`; only `default` when the RL Service has no such route (404)
    GET  /console/api/loras/{line} a line's LoRA state (active version, canary candidate, instances)

The token travels in the URL fragment, which browsers never send, so it reaches no access log; it is redeemed once.
Every API answer needs the cookie (else 401 `console_unauthorized`) and only GETs exist: the console changes nothing.
"""

from __future__ import annotations

import logging
import re
import time
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, urlencode

import orjson
from starlette.requests import Request
from starlette.responses import Response

from ...common import json_nesting
from ...common.lineage import DEFAULT_LINEAGE, InvalidLineage, split_line
from ...common.wire import routes as rl_routes
from ..lora.lora_manager import LoraManager
from ..responses import envelope, json_response
from ..rl.control import RLControl
from ..rl.supervisor import RLSupervisor, ServiceStatus
from .console_auth import COOKIE_NAME, ConsoleAuth

log = logging.getLogger("openjiuwen.agent_rl.gateway.console")

ASSET_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".html": "text/html; charset=utf-8", ".svg": "image/svg+xml"}
MAX_LOGIN_BODY_BYTES = 1024

_ID = r"[A-Za-z0-9_:-][A-Za-z0-9_.:-]{0,199}"  # one segment, never `.` or `..`
# Console path → RL Service path. Trajectory details (prompts, responses) are deliberately not offered.
_RL_READS: tuple[tuple[re.Pattern[str], rl_routes.Route], ...] = tuple((re.compile(p), t) for p, t in (
    (r"tasks", rl_routes.TASK_LIST),
    (rf"tasks/({_ID})", rl_routes.TASK),
    (rf"tasks/({_ID})/events", rl_routes.TASK_EVENTS),
    (r"runs", rl_routes.RUN_LIST),
    (rf"runs/({_ID})", rl_routes.RUN),
    (rf"runs/({_ID})/events", rl_routes.RUN_EVENTS),
    (r"policies", rl_routes.POLICIES),
    (r"rollout", rl_routes.ROLLOUT),
    (r"rollout/(ro-[0-9a-f]{12})/events", rl_routes.ROLLOUT_EVENTS),
    (r"trajectories/stats", rl_routes.TRAJECTORY_STATS),
))
_QUERY_KEYS = ("status", "limit", "cursor", "lineage")  # the listing parameters; anything else is dropped, not forwarded

_SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
    "x-frame-options": "DENY",
}


def _load_assets() -> dict[str, bytes]:
    folder = resources.files(__package__).joinpath("console_assets")
    return {entry.name: entry.read_bytes() for entry in folder.iterdir()
            if entry.is_file() and any(entry.name.endswith(ext) for ext in ASSET_TYPES)}


async def _bounded_body(request: Request, limit: int) -> bytes | None:
    """The body, or None as soon as it is known to exceed `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _now_ms() -> int:
    return int(time.time() * 1000)


class Console:
    def __init__(self, *, auth: ConsoleAuth, control: RLControl, loras: LoraManager, supervisor: RLSupervisor,
                 model_id: str, assets: dict[str, bytes] | None = None) -> None:
        self._auth = auth
        self._control = control
        self._loras = loras
        self._supervisor = supervisor
        self._model_id = model_id
        self._assets = assets if assets is not None else _load_assets()  # read once, before serving

    # ------------------------------------------------------------ pages

    def page(self, request: Request) -> Response:
        return self._asset("index.html" if self._authenticated(request) else "login.html")

    def login_page(self) -> Response:
        return self._asset("login.html")

    def asset(self, name: str) -> Response:
        if name.endswith(".html"):
            return envelope(404, "not_found", "no such console asset")  # pages only through their routes
        return self._asset(name)

    def _asset(self, name: str) -> Response:
        body = self._assets.get(name)
        if body is None:
            return envelope(404, "not_found", "no such console asset")
        media = ASSET_TYPES["." + name.rpartition(".")[2]]
        return Response(body, media_type=media, headers=_SECURITY_HEADERS)

    # ------------------------------------------------------------ session

    async def login(self, request: Request) -> Response:
        body = await _bounded_body(request, MAX_LOGIN_BODY_BYTES)  # unauthenticated: never read more than this
        if body is None:
            return envelope(413, "payload_too_large", "login body too large")
        try:
            token = json_nesting.loads(body).get("token")
        except (orjson.JSONDecodeError, AttributeError):
            return envelope(400, "invalid_request", 'body must be {"token": "..."}')
        now_ms = _now_ms()
        client = request.client.host if request.client else "?"
        if not self._auth.redeem(token, now_ms=now_ms):
            log.warning("console login refused for %s (invalid, expired or reused token)", client)
            return envelope(401, "console_unauthorized", "invalid, expired or already used login token")
        log.info("console session opened for %s", client)  # never the token or the cookie
        value, max_age_s = self._auth.issue(now_ms=now_ms)
        response = Response(status_code=204, headers={"cache-control": "no-store"})
        response.set_cookie(COOKIE_NAME, value, max_age=max_age_s, path="/console", httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")
        return response

    def logout(self) -> Response:
        response = Response(status_code=204, headers={"cache-control": "no-store"})
        response.delete_cookie(COOKIE_NAME, path="/console", httponly=True, samesite="strict")
        return response

    def _authenticated(self, request: Request) -> bool:
        return self._auth.session_ok(request.cookies.get(COOKIE_NAME), now_ms=_now_ms())

    def _refused(self, request: Request) -> Response | None:
        if self._authenticated(request):
            return None
        return envelope(401, "console_unauthorized", "log in with a link from `openjiuwen-rl rl console url`")

    # ------------------------------------------------------------ data

    async def overview(self, request: Request) -> Response:
        refused = self._refused(request)
        if refused:
            return refused
        service = self._supervisor.status()
        stats: Any = None
        if service["status"] == ServiceStatus.RUNNING:
            answer = await self._control.forward("GET", rl_routes.TRAJECTORY_STATS.path)
            stats = orjson.loads(answer.body) if answer.status_code == 200 else None
        data = {"model_id": self._model_id, "service": service, "lora": self._loras.describe(self._model_id),
                "trajectories": stats}
        return self._json(data)

    async def rl_read(self, request: Request, path: str) -> Response:
        refused = self._refused(request)
        if refused:
            return refused
        for pattern, target in _RL_READS:
            match = pattern.fullmatch(path)
            if match is not None:
                break
        else:
            return envelope(404, "not_found", "no such console route")
        query = urlencode([(k, v) for k, v in parse_qsl(request.url.query) if k in _QUERY_KEYS])
        answer = await self._control.forward("GET", target.fill(*match.groups()), query=query)
        answer.headers.update(_SECURITY_HEADERS)
        return answer

    async def lineages(self, request: Request) -> Response:
        """The selector's lineages, `default` first on the first page: the RL Service never lists `default` (it
        always exists), yet it is the selector's first choice. An RL Service without lineages (404 on the route) has
        only `default`: the answer says so (`lineages_supported: false`) rather than failing the page."""
        refused = self._refused(request)
        if refused:
            return refused
        params = [(k, v) for k, v in parse_qsl(request.url.query) if k in ("limit", "cursor")]
        answer = await self._control.forward("GET", rl_routes.LINEAGE_LIST.path, query=urlencode(params))
        default = {"lineage": DEFAULT_LINEAGE, "line": self._model_id}
        if answer.status_code == 404:
            return self._json({"items": [default], "next_cursor": None, "lineages_supported": False})
        if answer.status_code != 200:
            answer.headers.update(_SECURITY_HEADERS)  # the RL Service's own error envelope, passed on
            return answer
        try:
            page = orjson.loads(answer.body)
            listed = [item for item in page["items"] if item.get("lineage") != DEFAULT_LINEAGE]
        except (orjson.JSONDecodeError, TypeError, KeyError, AttributeError):
            return envelope(502, "upstream_invalid", "the RL Service's lineage list is not a listing")
        first_page = not any(k == "cursor" for k, _ in params)
        return self._json({**page, "items": ([default] if first_page else []) + listed, "lineages_supported": True})

    def lora(self, request: Request, line: str) -> Response:
        """`GET /v1/loras/{line}`'s view of one line, as the overview shows the default line's."""
        refused = self._refused(request)
        if refused:
            return refused
        try:
            model, _ = split_line(line)
        except InvalidLineage as exc:
            return envelope(400, "invalid_lineage", f"invalid line: {exc}")
        if model != self._model_id:
            return envelope(404, "model_not_found", f"this gateway serves {self._model_id}")
        return self._json(self._loras.describe(line))

    @staticmethod
    def _json(data: Any) -> Response:
        response = json_response(data)
        response.headers.update(_SECURITY_HEADERS)
        return response
