"""Calls from the gateway to its RL Service child: the capture hooks, internal finish/abort, and the proxied public
routes (CONTRACT §3.3, §3.5). Always with `Authorization: Bearer <RL_SERVICE_TOKEN>` of the current child.

Hooks are retried `hookRetries` times on transport errors and timeouts only — safe, since they are idempotent per
capture id; an HTTP answer is never retried. Hooks sit on every captured completion's path, so they go through the
lean keep-alive client (http11.py); the proxied control calls use httpx. A proxied call that is idempotent (a GET, a
Task start with the id the gateway minted, a stop, a terminal reward) is also sent again, as often, when its
connection broke before an answer (a worker of the RL Service died with it, CONTRACT §2.11); a timeout is not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from ...common import packed_hook
from ...common.wire import routes as rl_routes
from ...common.wire.task_states import FinishReason
from ..http11 import Http11Client, TransportError

if TYPE_CHECKING:
    from ..metrics import GatewayMetrics

log = logging.getLogger("openjiuwen.agent_rl.gateway.rl_client")


_BROKEN = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class HookUnreachable(RuntimeError):
    """No HTTP answer after the retries (transport error or timeout)."""


@dataclass(frozen=True, slots=True)
class RLAnswer:
    status: int
    body: bytes
    content_type: str

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class CaptureFailed(Exception):
    """The capture hook refused or failed a captured call: the gateway's own contract code, or the RL Service's
    answer to relay as it is (`relayed`). domain_errors.py turns either into the client's answer."""

    def __init__(self, code: str = "", message: str = "", *, relayed: RLAnswer | None = None) -> None:
        super().__init__(f"capture refused: {code or (relayed.status if relayed else '')}")
        self.code = code
        self.message = message
        self.relayed = relayed


class RLClient:
    def __init__(
        self,
        *,
        endpoint: str,
        token: Callable[[], str | None],
        hook_timeout_s: float,
        hook_retries: int,
        control_timeout_s: float,
        client: httpx.AsyncClient | None = None,
        hook_client: Http11Client | None = None,
        metrics: "GatewayMetrics | None" = None,
        packs_after: Callable[[], bool] = lambda: False,
    ) -> None:
        self._metrics = metrics
        self.packs_after = packs_after  # whether the running service takes the packed `:after` (its /health says)
        self._endpoint = endpoint.rstrip("/")
        self._token = token
        self._hook_timeout_s = hook_timeout_s
        self._hook_retries = hook_retries
        self._control_timeout_s = control_timeout_s
        # Idle connections are dropped well before the RL Service's keep-alive timeout (uvicorn: 5 s), so a call never
        # lands on a connection the server is closing.
        self._client = client or httpx.AsyncClient(
            trust_env=False, limits=httpx.Limits(max_connections=512, keepalive_expiry=2.0)
        )
        self._hooks = hook_client or Http11Client(keepalive_expiry_s=2.0)

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._hooks.aclose()

    def _headers(self, extra: dict[str, str | bytes] | None = None, *,
                 content_type: str = "application/json") -> dict[str, str | bytes]:
        headers: dict[str, str | bytes] = {"content-type": content_type}
        token = self._token()
        if token:
            headers["authorization"] = f"Bearer {token}"
        if extra:
            headers.update(extra)
        return headers

    async def hook(self, path: str, body: dict[str, Any] | bytes, *, packed: bool = False) -> RLAnswer:
        """POST a hook (a body, or its JSON bytes, or with `packed` its packed bytes) with the hook timeout and
        retries; raises HookUnreachable when nothing answered."""
        if self._metrics is None:
            return await self._hook(path, body, packed)
        name = path.rsplit(":", 1)[-1]  # before, after, discard, abort
        with self._metrics.hook(name):
            try:
                answer = await self._hook(path, body, packed)
            except HookUnreachable:
                self._metrics.hook_error(name, "unreachable")
                raise
        if not answer.ok:
            self._metrics.hook_error(name, str(answer.status))
        return answer

    async def _hook(self, path: str, body: dict[str, Any] | bytes, packed: bool) -> RLAnswer:
        payload = body if isinstance(body, bytes) else orjson.dumps(body)
        headers = self._headers(content_type=packed_hook.MEDIA_TYPE) if packed else self._headers()
        url = self._endpoint + path
        last: Exception | None = None
        for attempt in range(self._hook_retries + 1):
            try:
                resp = await self._hooks.request(
                    "POST", url, content=payload, headers=headers, timeout_s=self._hook_timeout_s
                )
            except TransportError as exc:  # includes timeouts
                last = exc
                log.warning("hook %s attempt %d failed: %s", path, attempt + 1, type(exc).__name__)
                continue
            return RLAnswer(resp.status, resp.body, resp.headers.get("content-type", "application/json"))
        raise HookUnreachable(f"{path}: {type(last).__name__}")

    async def before(self, body: dict[str, Any] | bytes) -> RLAnswer:
        return await self.hook(rl_routes.HOOK_BEFORE.path, body)

    async def after(self, body: dict[str, Any] | bytes, *, packed: bool = False) -> RLAnswer:
        return await self.hook(rl_routes.HOOK_AFTER.path, body, packed=packed)

    async def discard(self, body: dict[str, Any] | bytes) -> RLAnswer:
        return await self.hook(rl_routes.HOOK_DISCARD.path, body)

    async def abort(self, rl_task_id: str, reason: FinishReason) -> RLAnswer:
        return await self.hook(rl_routes.TASK_ABORT.fill(rl_task_id), {"reason": reason})

    async def metrics_text(self, timeout_s: float) -> bytes:
        """The RL Service's own `/metrics` (federated into the gateway's scrape); raises httpx errors."""
        resp = await self._client.get(self._endpoint + rl_routes.METRICS.path, headers=self._headers(), timeout=timeout_s)
        resp.raise_for_status()
        return resp.content

    async def forward(
        self, method: str, path: str, *, body: bytes = b"", query: str = "", headers: dict[str, str | bytes] | None = None
    ) -> RLAnswer:
        """A proxied public call, bounded by `controlTimeout`; raises httpx.TimeoutException / TransportError."""
        url = self._endpoint + path + (f"?{query}" if query else "")
        tries, attempt = (self._hook_retries + 1 if rl_routes.idempotent(method, path) else 1), 0
        while True:
            attempt += 1
            try:
                resp = await self._client.request(
                    method, url, content=body or None, headers=self._headers(headers), timeout=self._control_timeout_s
                )
            except _BROKEN as exc:
                if attempt >= tries:
                    raise
                log.warning("%s %s attempt %d failed: %s; sending it again", method, path, attempt,
                            type(exc).__name__)
                continue
            return RLAnswer(resp.status_code, resp.content, resp.headers.get("content-type", "application/json"))
