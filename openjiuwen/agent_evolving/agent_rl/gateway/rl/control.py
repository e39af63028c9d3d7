"""The gateway's RL control plane: service start/stop/status, Task start with pinning, Task stop with drain, and the
proxied public RL routes (CONTRACT §3.3, §3.4).

`agent_key` is the id of the agent key that signed a call (None for the operator key). The RL Service is told it on
Task start (the Task's owner) and on stop and reward (the caller), and answers another key's Task as unknown; the
gateway refuses a stop of another key's Task itself before draining it, so that no agent can make another's Task
wait for, or time out on, its in-flight captures."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from ...common.ids import is_task_id
from ...common.lineage import DEFAULT_LINEAGE, InvalidLineage, line_of
from ...common.wire import headers as wire_headers
from ...common.wire import routes as rl_routes
from ...common.wire.task_states import ENDED_TASK_STATUSES, FinishReason, TaskStatus
from ..auth import capture_secret
from ..lora.lora_manager import LoraManager
from ..responses import envelope, json_response, passthrough
from .rl_client import HookUnreachable, RLAnswer, RLClient
from .sessions import Binding
from .supervisor import RLSupervisor, ServiceStatus, SupervisorError
from .task_access import LineageGuard
from .task_lineage import decode_start_body, requested_lineage
from .tasks import TaskTracker

log = logging.getLogger("openjiuwen.agent_rl.gateway.control")


class RLControl:
    def __init__(
        self,
        *,
        model_id: str,
        supervisor: RLSupervisor,
        rl: RLClient,
        tracker: TaskTracker,
        loras: LoraManager,
        drain_timeout_s: float,
        agent_lineages: Mapping[str, frozenset[str]] | None = None,
        agent_lineage_caps: Mapping[str, int] | None = None,
    ) -> None:
        """`agent_lineages`: agent key id → the lineages whose Tasks it may start, stop and reward (a key absent
        here: every one). `agent_lineage_caps`: agent key id → how many lineages it may register, sent to the RL
        Service with each of its Task starts (`X-AIGW-RL-Max-Lineages`), which counts them atomically."""
        self._model_id = model_id
        self._supervisor, self._rl, self._loras = supervisor, rl, loras
        self._tracker, self._sessions = tracker, tracker.sessions
        self._drain_timeout_s = drain_timeout_s
        self._agent_lineages = dict(agent_lineages or {})
        self._agent_lineage_caps = dict(agent_lineage_caps or {})
        self._lineage_guard = LineageGuard(self._agent_lineages, self._sessions, rl)
        self._background: set[asyncio.Task[None]] = set()  # stops of Tasks past the lease cap

    def _cap_header(self, agent_key: str | None) -> dict[str, str]:
        cap = self._agent_lineage_caps.get(agent_key) if agent_key is not None else None
        return {} if cap is None else {wire_headers.MAX_LINEAGES: str(cap)}

    def running(self) -> bool:
        return self._supervisor.status()["status"] == ServiceStatus.RUNNING

    # ------------------------------------------------------------ service

    async def service_start(self) -> Response:
        try:
            return json_response(await self._supervisor.start())
        except SupervisorError as exc:
            return envelope(503, "rl_service_unavailable", str(exc))

    async def service_stop(self) -> Response:
        status = await self._supervisor.stop(drain=self._drain_all)
        await self._tracker.release_all()
        return json_response(status)

    def service_status(self) -> Response:
        return json_response(self._supervisor.status())

    async def _drain_all(self) -> None:
        for rl_task_id in self._sessions.all_tasks():
            if not await self._sessions.drain(rl_task_id, self._drain_timeout_s):
                log.warning("task %s still had captures in flight when the service stopped", rl_task_id)

    # ------------------------------------------------------------ tasks

    async def task_start(self, request: Request, body: bytes, *, agent_key: str | None) -> Response:
        if not self.running():
            return envelope(503, "rl_service_unavailable", "the RL Service is not running")
        data = decode_start_body(body)  # once, for the lineage and the secret request
        try:
            lineage = requested_lineage(data)
        except InvalidLineage as exc:
            return envelope(400, "invalid_lineage", f"lineage: {exc}")
        allowed = self._agent_lineages.get(agent_key) if agent_key is not None else None
        if allowed is not None and lineage not in allowed:  # fails closed: an empty limit allows nothing
            return envelope(403, "lineage_forbidden", f"this agent key may not start Tasks in the lineage {lineage}")
        try:
            wants_secret, body = _take_secret_request(data, body)
        except ValueError as exc:
            return envelope(400, "invalid_task_request", str(exc))
        rl_task_id = "t" + uuid.uuid4().hex
        # The Task's policy comes from its lineage's line (active, or the canary candidate by the split).
        policy_name, policy_model = self._loras.snapshot(line_of(self._model_id, lineage), rl_task_id=rl_task_id)
        self._tracker.lease(policy_name)
        headers: dict[str, str | bytes] = {
            # The bytes as received: the RL Service judges the format (400 `missing_session_id`); re-encoding a
            # non-ASCII value as text would fail here instead.
            wire_headers.SESSION_ID: request.headers.get(wire_headers.SESSION_ID, "").encode("latin-1"),
            wire_headers.TASK_ID: rl_task_id,
            wire_headers.POLICY_NAME: policy_name,
            wire_headers.POLICY_MODEL: policy_model,
            wire_headers.LINEAGE: lineage,  # always, `default` included: the RL Service knows the gateway pins by lineage
            **_agent_header(agent_key),
            **self._cap_header(agent_key),
        }
        try:
            answer = await self._rl.forward("POST", rl_routes.TASK_START.path, body=body, headers=headers)
        except httpx.HTTPError as exc:
            await self._tracker.unlease(policy_name)
            return self._transport_failure(exc)
        if answer.status not in (200, 201):
            await self._tracker.unlease(policy_name)
            return passthrough(answer)
        record = answer.json()
        if record.get("status") != TaskStatus.ACTIVE:
            await self._tracker.unlease(policy_name)
            return passthrough(answer)
        # The RL Service's record says the Task's lineage (absent: `default`); the key's limit was checked against
        # the lineage asked for, so a Task of another lineage is never bound or answered here (fails closed).
        if record.get("lineage", DEFAULT_LINEAGE) != lineage:
            await self._tracker.unlease(policy_name)
            return envelope(409, "task_conflict", "the session has an active RL Task of another lineage; stop it "
                                                  "before starting one of this lineage")
        # A repeated start answers the session's existing Task: it keeps the secret it was created with (or none).
        existing = self._sessions.for_task(record["rl_task_id"])
        secret: str | None = None
        digest = existing.secret_digest if existing is not None else None
        if existing is None and wants_secret and answer.status == 201:
            secret, digest = capture_secret.mint()
        binding = Binding(
            rl_task_id=record["rl_task_id"], session_id=record["agent_session_id"],
            policy_name=record["policy_lora_name"], policy_model=record["policy_model"],
            reward_mode=record["reward_mode"], agent_key=record.get("agent_key_id"), secret_digest=digest,
            lineage=lineage,  # the record's, checked above
        )
        await self._tracker.adopt(binding, leased_policy=policy_name)
        self._bound_leases_soon(line_of(self._model_id, lineage))
        if wants_secret and secret is None:
            return envelope(409, "capture_secret_unavailable",
                            f"the session already has the active Task {record['rl_task_id']}; a capture secret is "
                            "issued only to a Task this start creates (stop that Task first)")
        if secret is not None:
            # Shown once: only its digest stays on the gateway.
            return Response(orjson.dumps({**record, capture_secret.ANSWER_FIELD: secret}), status_code=answer.status,
                            media_type="application/json", headers={"cache-control": "no-store"})
        return passthrough(answer)

    async def task_stop(self, rl_task_id: str, body: bytes, *, agent_key: str | None) -> Response:
        if not self.running():
            return envelope(503, "rl_service_unavailable", "the RL Service is not running")
        if not is_task_id(rl_task_id):  # a malformed id is simply unknown; it never reaches a path or an abort
            return envelope(404, "task_not_found", "RL Task not found")
        binding = self._sessions.for_task(rl_task_id)
        if agent_key is not None and binding is not None and binding.agent_key != agent_key:
            return envelope(404, "task_not_found", "RL Task not found")  # another key's Task: unknown to this one
        refused = await self._lineage_guard.refusal(rl_task_id, agent_key)
        if refused is not None:
            return refused
        if not await self._sessions.drain(rl_task_id, self._drain_timeout_s):
            # The in-flight completion still finishes for its client; its capture is refused once aborted.
            await self._tracker.release(rl_task_id)
            try:
                await self._rl.abort(rl_task_id, FinishReason.TIMEOUT)
            except HookUnreachable:
                log.warning("could not abort task %s after its drain timeout", rl_task_id)
            return envelope(504, "task_drain_timeout", "captures of the Task were still in flight")
        return await self.forward("POST", rl_routes.TASK_STOP.fill(rl_task_id), body=body, task_id=rl_task_id,
                                  agent_key=agent_key)

    async def bound_leases(self, line: str | None = None) -> None:
        """Stop the Tasks pinned to versions past the lease cap (`LoraManager.leased_past_cap`: of `line`, or of
        every line), as an operator's stop does: drained, finalized by the RL Service (their samples kept, their
        rewards still taken), their leases released, so that those versions are unloaded."""
        past = set(self._loras.leased_past_cap(line))
        if not past:
            return
        pinned = [b for b in map(self._sessions.for_task, self._sessions.all_tasks())
                  if b is not None and b.policy_name in past]
        for binding in pinned:
            log.warning("stopping task %s: its version %s is older than the newest lora.maxLeasedVersionsPerLine "
                        "versions its line's Tasks hold", binding.rl_task_id, binding.policy_name)
        await asyncio.gather(*(self.task_stop(b.rl_task_id, b"", agent_key=None) for b in pinned))

    def _bound_leases_soon(self, line: str) -> None:
        """After a Task start: the line's Tasks may hold more versions than the cap since its last switch."""
        if not self._loras.leased_past_cap(line):
            return
        task = asyncio.create_task(self.bound_leases(line), name=f"lease-cap:{line}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Cancel the lease-cap stops still running (gateway shutdown)."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def task_reward(self, rl_task_id: str, path: str, body: bytes, *, query: str,
                          agent_key: str | None) -> Response:
        """A Task's reward, proxied once the caller's lineage limit allows the Task (`path` as the client encoded
        it)."""
        if not self.running():
            return envelope(503, "rl_service_unavailable", "the RL Service is not running")
        refused = await self._lineage_guard.refusal(rl_task_id, agent_key)
        if refused is not None:
            return refused
        return await self.forward("POST", path, body=body, query=query, agent_key=agent_key)

    # ------------------------------------------------------------ proxy

    async def rail_upload(self, path: str, body: bytes, *, query: str, agent_key: str | None) -> Response:
        """A rail-v1 batch, proxied as it came once the agent key's lineage limit allows the default line."""
        refused = self._lineage_guard.rail_refusal(agent_key)
        if refused is not None:
            return refused
        return await self.forward("POST", path, body=body, query=query, agent_key=agent_key)

    async def forward(
        self, method: str, path: str, *, body: bytes = b"", query: str = "", task_id: str | None = None,
        agent_key: str | None = None,
    ) -> Response:
        if not self.running():
            return envelope(503, "rl_service_unavailable", "the RL Service is not running")
        try:
            answer = await self._rl.forward(method, path, body=body, query=query, headers=_agent_header(agent_key))
        except httpx.InvalidURL:  # a path or query no URL can carry: the client's mistake
            return envelope(400, "invalid_request", "the request path or query cannot be forwarded")
        except httpx.HTTPError as exc:
            return self._transport_failure(exc)
        if task_id is not None:
            await self._release_if_terminal(task_id, answer)
        return passthrough(answer)

    async def _release_if_terminal(self, rl_task_id: str, answer: RLAnswer) -> None:
        if answer.status == 404:
            await self._tracker.release(rl_task_id)
            return
        if answer.status >= 500:
            # A failed stop may have aborted the Task (a Judge failure in the final publication) or left it active
            # (Redis unreachable): ask.
            try:
                answer = await self._rl.forward("GET", rl_routes.TASK.fill(rl_task_id))
            except httpx.HTTPError:
                return
        if answer.ok:
            try:
                status = answer.json().get("status")
            except (orjson.JSONDecodeError, AttributeError):
                return
            if status in ENDED_TASK_STATUSES:
                await self._tracker.release(rl_task_id)

    @staticmethod
    def _transport_failure(exc: httpx.HTTPError) -> Response:
        if isinstance(exc, httpx.TimeoutException):
            return envelope(504, "rl_service_timeout", "the RL Service did not answer in time")
        return envelope(503, "rl_service_unavailable", f"the RL Service is unreachable: {type(exc).__name__}")


def _agent_header(agent_key: str | None) -> dict[str, str | bytes]:
    """The header naming the calling agent key to the RL Service; none for the operator key."""
    return {} if agent_key is None else {wire_headers.AGENT_KEY: agent_key}


def _take_secret_request(data: dict[str, Any] | None, body: bytes) -> tuple[bool, bytes]:
    """(whether the signed start body asks for a capture secret, the body to forward without that gateway field).
    `data` is the body decoded (None: no JSON object). A body that is not a JSON object, or has no such field, is
    forwarded as it came (the RL Service judges it)."""
    if data is None or capture_secret.REQUEST_FIELD not in data:
        return False, body
    data = dict(data)  # the caller's decoded body stays as it came
    wants = data.pop(capture_secret.REQUEST_FIELD)
    if not isinstance(wants, bool):
        raise ValueError(f"{capture_secret.REQUEST_FIELD} must be true or false")
    return wants, orjson.dumps(data)
