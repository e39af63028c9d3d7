"""A fake of the gateway's internal LoRA routes (CONTRACT §3.8) on a real socket, scripted per request.

    async with FakeGateway(model_id="tiny") as gw:          # or `with` in sync tests
        gw.activate_plan.extend([Fail(503), Ok()])        # first activation 503, then the real CAS semantics
        gw.activate_plan.append(Hang(5.0, switch=True))   # switch, then answer too late (client times out)
        gw.policy_plan.append(Fail(500))                  # the next policy read fails
        gw.active                                         # (lora_name, lora_path) or None
        gw.activations                                    # bodies of every activation request

`retire_plan` scripts `POST /internal/v1/rl/loras/retire` (lineage lifecycle), `retired` lists the lines retired.
`Ok` applies the gateway's semantics: same name and path active → 200; current (name or `base`) ≠
`expected_lora_name` → 409 `lora_cas_conflict`; else switch → 200. Plans are consumed in arrival order; when empty,
`Ok` applies. Hangs end early when the fake stops.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from openjiuwen.agent_evolving.agent_rl.common.lineage import parse_version_name
from tests.support.asgi_server import ThreadedServer


@dataclass(frozen=True)
class Ok:
    pass


@dataclass(frozen=True)
class Fail:
    status: int
    body: str = '{"error": {"code": "fake_failure", "message": "scripted"}}'


@dataclass(frozen=True)
class Hang:
    seconds: float
    switch: bool = False  # apply the activation before hanging (the answer is lost, the switch is not)


Behaviour = Ok | Fail | Hang


class FakeGateway:
    def __init__(self, *, model_id: str, active: tuple[str, str] | None = None, token: str | None = None,
                 canary: bool = False) -> None:
        """`canary`: also serve the canary routes (CONTRACT §3.8 "Canary": status, start, abort; `canary_plan`
        scripts the starts, `candidate` is the (lora_name, lora_path) held, `canary_calls` every (action, body))."""
        self.model_id = model_id
        self.active = active
        # Lineages (docs/lineages.md wire 4): the active version of each non-default line, and every line read.
        self.line_active: dict[str, tuple[str, str]] = {}
        self.policy_lines: list[str] = []
        self.token = token
        self.activate_plan: deque[Behaviour] = deque()
        self.policy_plan: deque[Behaviour] = deque()
        self.activations: list[dict[str, Any]] = []
        self.policy_reads = 0
        self.unauthorized = 0
        self.candidate: tuple[str, str] | None = None
        self.line_candidates: dict[str, tuple[str, str]] = {}  # the candidate of each non-default line
        self.canary_plan: deque[Behaviour] = deque()
        self.canary_calls: list[tuple[str, dict[str, Any]]] = []
        # Lineage lifecycle (docs/lineages.md "Lifecycle"): every retired line, and failures scripted per request.
        self.retired: list[str] = []
        self.retire_plan: deque[Behaviour] = deque()
        self._lock = threading.Lock()
        self._stopping = asyncio.Event()
        app = Starlette(routes=[
            Route("/internal/v1/rl/loras/{line}", self._policy, methods=["GET"]),
            Route("/internal/v1/rl/loras/activate", self._activate, methods=["POST"]),
            Route("/internal/v1/rl/loras/retire", self._retire, methods=["POST"]),
        ] + ([
            Route("/internal/v1/rl/canary/{line}", self._canary_status, methods=["GET"]),
            Route("/internal/v1/rl/canary/start", self._canary_start, methods=["POST"]),
            Route("/internal/v1/rl/canary/abort", self._canary_abort, methods=["POST"]),
            Route("/internal/v1/rl/canary/promote", self._canary_promote, methods=["POST"]),
        ] if canary else []))
        self._server = ThreadedServer(app, name="fake-gateway")

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> "FakeGateway":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> "FakeGateway":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> "FakeGateway":
        await self._server.astart()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.astop()

    def _policy_body(self, line: str | None = None) -> dict[str, Any]:
        active = self.active if line in (None, self.model_id) else self.line_active.get(line)
        if active is None:
            return {"status": "base", "active_lora": None, "instances": {"ready": 1, "failed": 0}}
        name, path = active
        return {"status": "active", "active_lora": {"lora_name": name, "lora_path": path},
                "instances": {"ready": 1, "failed": 0}}

    def _authorized(self, request: Request) -> bool:
        if self.token and request.headers.get("authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return False
        return True

    async def _policy(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": {"code": "unauthorized", "message": "x"}}, status_code=401)
        line = request.path_params["line"]
        if line != self.model_id and not line.startswith(f"{self.model_id}:"):
            return JSONResponse({"error": {"code": "model_not_found", "message": line}}, status_code=404)
        with self._lock:
            self.policy_reads += 1
            self.policy_lines.append(line)
            behaviour = self.policy_plan.popleft() if self.policy_plan else Ok()
        if isinstance(behaviour, Fail):
            return Response(behaviour.body, status_code=behaviour.status, media_type="application/json")
        if isinstance(behaviour, Hang):
            await asyncio.sleep(behaviour.seconds)
        return JSONResponse(self._policy_body(line))

    async def _activate(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": {"code": "unauthorized", "message": "x"}}, status_code=401)
        body = await request.json()
        with self._lock:
            self.activations.append(body)
            behaviour = self.activate_plan.popleft() if self.activate_plan else Ok()
        parsed = parse_version_name(body.get("lora_name"))
        if parsed is not None and parsed[0] != self.model_id:  # a lineage's version: its own line's state
            line = parsed[0]
            current = self.line_active.get(line, ("base", ""))[0]
            if current != body["expected_lora_name"] and current != body["lora_name"]:
                return JSONResponse(
                    {"error": {"code": "lora_cas_conflict", "message": f"active is {current}"}}, status_code=409
                )
            self.line_active[line] = (body["lora_name"], body["lora_path"])
            return JSONResponse({"status": "active", "active_lora": self._policy_body(line)["active_lora"]})
        if isinstance(behaviour, Fail):
            return Response(behaviour.body, status_code=behaviour.status, media_type="application/json")
        if isinstance(behaviour, Hang):
            if behaviour.switch:
                self.active = (body["lora_name"], body["lora_path"])
            await asyncio.sleep(behaviour.seconds)
            return JSONResponse({"status": "active"})
        current = self.active[0] if self.active else "base"
        if self.active == (body["lora_name"], body["lora_path"]):
            return JSONResponse({"status": "active", "active_lora": self._policy_body()["active_lora"]})
        if current != body["expected_lora_name"]:
            return JSONResponse(
                {"error": {"code": "lora_cas_conflict", "message": f"active is {current}"}}, status_code=409
            )
        self.active = (body["lora_name"], body["lora_path"])
        return JSONResponse({"status": "active", "active_lora": self._policy_body()["active_lora"]})

    async def _retire(self, request: Request) -> Response:
        """The gateway's semantics: a non-default line of this model stops serving its active version and its
        candidate (400 `invalid_lineage` for the default line)."""
        if not self._authorized(request):
            return JSONResponse({"error": {"code": "unauthorized", "message": "x"}}, status_code=401)
        line = (await request.json()).get("line")
        with self._lock:
            behaviour = self.retire_plan.popleft() if self.retire_plan else Ok()
        if isinstance(behaviour, Fail):
            return Response(behaviour.body, status_code=behaviour.status, media_type="application/json")
        if not isinstance(line, str) or not line.startswith(f"{self.model_id}:"):
            return JSONResponse({"error": {"code": "invalid_lineage", "message": str(line)}}, status_code=400)
        with self._lock:
            served = sorted(v[0] for v in (self.line_active.pop(line, None), self.line_candidates.pop(line, None))
                            if v is not None)
            self.retired.append(line)
        return JSONResponse({"status": "retired", "line": line, "versions": served})

    def _line_of(self, lora_name: object) -> str:
        parsed = parse_version_name(lora_name)
        return parsed[0] if parsed is not None else self.model_id

    def _candidate(self, line: str) -> tuple[str, str] | None:
        return self.candidate if line == self.model_id else self.line_candidates.get(line)

    def _set_candidate(self, line: str, value: tuple[str, str] | None) -> None:
        if line == self.model_id:
            self.candidate = value
        elif value is None:
            self.line_candidates.pop(line, None)
        else:
            self.line_candidates[line] = value

    def _canary_body(self, line: str | None = None) -> dict[str, Any]:
        line = line or self.model_id
        held = self._candidate(line)
        candidate = None
        if held is not None:
            candidate = {"lora_name": held[0], "lora_path": held[1], "share": 0.5,
                         "started_at": "2026-01-01T00:00:00+00:00", "instances": {"ready": 1}}
        return {**self._policy_body(line), "candidate": candidate, "leases": {}}

    async def _canary_status(self, request: Request) -> Response:
        line = request.path_params["line"]
        if line != self.model_id and not line.startswith(f"{self.model_id}:"):
            return JSONResponse({"error": {"code": "model_not_found", "message": line}}, status_code=404)
        return JSONResponse(self._canary_body(line))

    async def _canary_start(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.canary_calls.append(("start", body))
            behaviour = self.canary_plan.popleft() if self.canary_plan else Ok()
        line = self._line_of(body["lora_name"])
        if isinstance(behaviour, Fail):
            return Response(behaviour.body, status_code=behaviour.status, media_type="application/json")
        if isinstance(behaviour, Hang):
            if behaviour.switch:
                self._set_candidate(line, (body["lora_name"], body["lora_path"]))
            await asyncio.sleep(behaviour.seconds)
        held = self._candidate(line)
        if held is not None and held[0] != body["lora_name"]:  # one candidate per line, as the gateway
            return JSONResponse({"error": {"code": "canary_conflict", "message": f"{held[0]} is the candidate"}},
                                status_code=409)
        self._set_candidate(line, (body["lora_name"], body["lora_path"]))
        return JSONResponse(self._canary_body(line))

    async def _canary_abort(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.canary_calls.append(("abort", body))
        line = self._line_of(body["lora_name"])
        held = self._candidate(line)
        if held is not None and held[0] == body["lora_name"]:
            self._set_candidate(line, None)
        return JSONResponse(self._canary_body(line))

    async def _canary_promote(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.canary_calls.append(("promote", body))
        line = self._line_of(body["lora_name"])
        active = self.active if line == self.model_id else self.line_active.get(line)
        current = active[0] if active else "base"
        held = self._candidate(line)
        if held is None:
            if current == body["lora_name"]:
                return JSONResponse(self._canary_body(line))  # promoted already
            return JSONResponse({"error": {"code": "no_canary", "message": "x"}}, status_code=409)
        if held[0] != body["lora_name"] or current != body["expected_lora_name"]:
            return JSONResponse({"error": {"code": "lora_cas_conflict", "message": "x"}}, status_code=409)
        if line == self.model_id:
            self.active = held
        else:
            self.line_active[line] = held
        self._set_candidate(line, None)
        return JSONResponse(self._canary_body(line))
