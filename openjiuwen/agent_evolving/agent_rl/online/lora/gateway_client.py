"""The RL Service's calls to the gateway's LoRA routes (CONTRACT §3.8, D3, D11).

`read_policy` is one request (run start never retries it); `activate` retries 5xx and connection errors with
exponential backoff inside one deadline, never retries a 4xx, and reconciles with a policy read before reporting a
failure that is not a 4xx.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from ...common.lineage import parse_version_name

from ...common.policy_names import BASE_POLICY

log = logging.getLogger("openjiuwen.agent_rl.online.lora")

BACKOFF_FIRST_S = 1.0
BACKOFF_CAP_S = 10.0


@dataclass(frozen=True, slots=True)
class Policy:
    lora_name: str  # "base" or "<model>:vN"
    lora_path: str  # "" for base


class GatewayError(RuntimeError):
    """A LoRA call failed; the message is the contract's failure text."""


class GatewayRejected(GatewayError):
    """The gateway answered 4xx (e.g. 409 `lora_cas_conflict`): not retried."""


class GatewayTransient(GatewayError):
    """5xx or a transport error: retried within the deadline."""


def backoff_delays(*, attempts: int, first_s: float = BACKOFF_FIRST_S, cap_s: float = BACKOFF_CAP_S) -> Iterator[float]:
    """1, 2, 4 … s capped, one per attempt; 0 after the last one."""
    delay = first_s
    for attempt in range(attempts):
        yield 0.0 if attempt == attempts - 1 else delay
        delay = min(delay * 2, cap_s)


def parse_policy(body: Any) -> Policy:
    if not isinstance(body, dict):
        raise GatewayError("query answer is not a JSON object")
    active = body.get("active_lora")
    if body.get("status") == BASE_POLICY or not isinstance(active, dict):
        return Policy(BASE_POLICY, "")
    name = active.get("lora_name")
    path = active.get("lora_path")
    return Policy(name if isinstance(name, str) and name else BASE_POLICY, path if isinstance(path, str) else "")


class GatewayLoraClient:
    def __init__(
        self,
        *,
        endpoint: str,
        model_id: str,
        timeout_s: float,
        attempts: int,
        token: str | None = None,
        client: httpx.AsyncClient | None = None,
        on_attempt: Callable[[str], None] | None = None,
    ) -> None:
        self._on_attempt = on_attempt or (lambda result: None)  # metrics: one call per activation request
        self._endpoint = endpoint.rstrip("/")
        self._model_id = model_id
        self._timeout_s = timeout_s
        self._attempts = attempts
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            headers=headers, trust_env=False, limits=httpx.Limits(keepalive_expiry=2.0)
        )
        if client is not None and headers:
            self._client.headers.update(headers)

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _read_once(self, timeout_s: float, line: str | None = None) -> Policy:
        # A lineage's line takes the model id's place (docs/lineages.md wire 4); the default line is the model id.
        url = f"{self._endpoint}/internal/v1/rl/loras/{line or self._model_id}"
        try:
            resp = await self._client.get(url, timeout=max(timeout_s, 0.001))
        except httpx.TimeoutException as exc:
            raise GatewayTransient("LoRA policy query timed out") from exc
        except httpx.TransportError as exc:
            raise GatewayTransient(f"LoRA policy query failed: {type(exc).__name__}") from exc
        if resp.status_code >= 500:
            raise GatewayTransient(f"query status {resp.status_code}: {resp.text[:500]}")
        if not resp.is_success:
            raise GatewayRejected(f"query status {resp.status_code}: {resp.text[:500]}")
        try:
            return parse_policy(orjson.loads(resp.content))
        except orjson.JSONDecodeError as exc:
            raise GatewayError("query answer is not valid JSON") from exc

    async def read_policy(self, line: str | None = None) -> Policy:
        """One request bounded by `lora_activation_timeout` (run start: a failure is 502, never retried)."""
        return await self._read_once(self._timeout_s, line)

    async def read_policy_retrying(self, *, timeout_s: float | None = None, line: str | None = None) -> Policy:
        """Reconciliation and recovery: retried like activation within one deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self._timeout_s)
        last: GatewayError = GatewayTransient("LoRA policy query timed out")
        for delay in backoff_delays(attempts=self._attempts):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                return await self._read_once(remaining, line)
            except GatewayTransient as exc:
                last = exc
            if delay and deadline - loop.time() > delay:
                await asyncio.sleep(delay)
            elif delay:
                break
        raise last

    async def activate(self, *, base_model: str, lora_name: str, lora_path: str, expected: str, run_id: str) -> None:
        """Activate with compare-and-swap on `expected`; returns on success, raises GatewayError otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        body = {
            "base_model": base_model, "lora_name": lora_name, "lora_path": lora_path,
            "expected_lora_name": expected, "training_run_id": run_id,
        }
        url = f"{self._endpoint}/internal/v1/rl/loras/activate"
        answered, failure = await self._post_retrying(url, body, deadline, request="LoRA activation",
                                                      status="activation", on_attempt=self._on_attempt)
        if answered is not None:
            return
        # Before reporting a failure that may hide a success (timeout, exhausted retries), ask what is active.
        try:
            # The version's own line: `<line>:vN` (the gateway derives the line from the name the same way).
            parsed = parse_version_name(lora_name)
            policy = await self._read_once(max(deadline - loop.time(), 1.0), parsed[0] if parsed else None)
        except GatewayError:
            raise GatewayError(failure) from None
        if policy.lora_name == lora_name:
            log.info("activation of %s reconciled: the gateway reports it active", lora_name)
            return
        raise GatewayError(failure)

    async def retire_line(self, line: str) -> None:
        """`POST /internal/v1/rl/loras/retire {"line"}` (docs/lineages.md "Lifecycle"): the line serves nothing more at
        the gateway and its versions are unloaded. Retried like activation; a failure that may hide a success is
        reconciled with a read of the line (base, no candidate: done). Raises GatewayError otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        url = f"{self._endpoint}/internal/v1/rl/loras/retire"
        answered, failure = await self._post_retrying(url, {"line": line}, deadline, request="line retirement",
                                                      status="retirement")
        if answered is not None:
            return
        try:
            policy = await self._read_once(max(deadline - loop.time(), 1.0), line)
            candidate = (await self.canary_status(line)).get("candidate")
        except GatewayError:
            raise GatewayError(failure) from None
        if policy.lora_name == BASE_POLICY and not candidate:
            return
        raise GatewayError(failure)

    async def _post_retrying(self, url: str, body: dict[str, Any], deadline: float, *, request: str, status: str,
                             on_attempt: Callable[[str], None] = lambda result: None,
                             ) -> tuple[httpx.Response | None, str]:
        """POST `body` within `deadline`: timeouts, transport errors and 5xx retried with backoff, a 4xx raised at
        once (GatewayRejected). (the 2xx answer, "") or, when the retries ran out, (None, the last failure), which
        the caller reconciles with a read before reporting it (a timeout may hide a success)."""
        loop = asyncio.get_running_loop()
        failure = f"{request} request timed out"
        for attempt, delay in enumerate(backoff_delays(attempts=self._attempts), start=1):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                resp = await self._client.post(url, json=body, timeout=remaining)
            except httpx.TimeoutException:
                result, failure = "timeout", f"{request} request timed out"
            except httpx.TransportError as exc:
                result, failure = "transport_error", f"{request} request failed: {type(exc).__name__}"
            else:
                if resp.is_success:
                    on_attempt("success")
                    return resp, ""
                text = f"{status} status {resp.status_code}: {resp.text[:500]}"
                if resp.status_code < 500:
                    on_attempt("rejected")
                    raise GatewayRejected(text)
                result, failure = "server_error", text
            on_attempt(result)
            log.warning("%s of %s attempt %d failed: %s", request, body.get("lora_name") or body.get("line"), attempt,
                        failure)
            if delay == 0 or deadline - loop.time() <= delay:
                break
            await asyncio.sleep(delay)
        return None, failure

    # ------------------------------------------------------------------ canary (docs/rollout.md, CONTRACT §3.8 ext)

    async def canary_status(self, line: str | None = None) -> dict[str, Any]:
        """`GET /internal/v1/rl/canary/{line}` once (None: the default line, the model id). A gateway without the
        canary routes answers 404: GatewayRejected with `missing_canary_routes` in its text, so start-up can say
        so."""
        url = f"{self._endpoint}/internal/v1/rl/canary/{line or self._model_id}"
        try:
            resp = await self._client.get(url, timeout=self._timeout_s)
        except httpx.TimeoutException as exc:
            raise GatewayTransient("canary status query timed out") from exc
        except httpx.TransportError as exc:
            raise GatewayTransient(f"canary status query failed: {type(exc).__name__}") from exc
        if resp.status_code in (404, 405):
            raise GatewayRejected("missing_canary_routes: the gateway has no /internal/v1/rl/canary routes "
                                  f"(status {resp.status_code}); it predates canary rollouts")
        if resp.status_code >= 500:
            raise GatewayTransient(f"canary status {resp.status_code}: {resp.text[:500]}")
        if not resp.is_success:
            raise GatewayRejected(f"canary status {resp.status_code}: {resp.text[:500]}")
        try:
            body = orjson.loads(resp.content)
        except orjson.JSONDecodeError as exc:
            raise GatewayError("canary status answer is not valid JSON") from exc
        if not isinstance(body, dict):
            raise GatewayError("canary status answer is not a JSON object")
        return body

    async def start_canary(self, *, base_model: str, lora_name: str, lora_path: str, expected: str,
                           share: float) -> dict[str, Any]:
        body = {"base_model": base_model, "lora_name": lora_name, "lora_path": lora_path,
                "expected_lora_name": expected, "share": share}
        return await self._canary_call(
            "start", body, lambda s: (s.get("candidate") or {}).get("lora_name") == lora_name)

    async def promote_canary(self, *, base_model: str, lora_name: str, expected: str) -> dict[str, Any]:
        body = {"base_model": base_model, "lora_name": lora_name, "expected_lora_name": expected}
        return await self._canary_call(
            "promote", body, lambda s: parse_policy(s).lora_name == lora_name and not s.get("candidate"))

    async def abort_canary(self, *, base_model: str, lora_name: str) -> dict[str, Any]:
        body = {"base_model": base_model, "lora_name": lora_name}
        return await self._canary_call(
            "abort", body, lambda s: (s.get("candidate") or {}).get("lora_name") != lora_name
            and parse_policy(s).lora_name != lora_name)

    async def _canary_call(self, action: str, body: dict[str, Any],
                           done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """POST with the activation discipline: 5xx and transport errors retried with backoff inside one
        deadline, 4xx never; before reporting a failure that may hide a success, the canary state is read and
        `done(state)` decides."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        url = f"{self._endpoint}/internal/v1/rl/canary/{action}"
        # The reconciling read asks the version's own line (the gateway derives it from the name the same way).
        parsed = parse_version_name(body.get("lora_name"))
        answered, failure = await self._post_retrying(url, body, deadline, request=f"canary {action}",
                                                      status=f"canary {action}")
        if answered is not None:
            try:
                answer = orjson.loads(answered.content)
            except orjson.JSONDecodeError:
                answer = {}
            return answer if isinstance(answer, dict) else {}
        try:
            state = await self.canary_status(parsed[0] if parsed else None)
        except GatewayError:
            raise GatewayError(failure) from None
        if done(state):
            return state
        raise GatewayError(failure)
