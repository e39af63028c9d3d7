"""The operator CLI's HTTP side: signed requests to one gateway, and the errors a command ends with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from ..gateway.console.console_auth import login_token
from ..common.hmac_signing import HmacAuth
from ..common.signing_keys import SigningKey


class CliError(Exception):
    """A failure to report as `error: <message>` with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ErrorAnswer(CliError):
    """A non-2xx answer: its status and the envelope's code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        hint = " (check the HMAC key, and that this machine's clock is within 300 s)" if status == 401 else ""
        super().__init__(f"{status} {code}: {message}{hint}")
        self.status = status
        self.code = code


def path_segment(segment: str) -> str:
    return quote(segment, safe="")  # an id is one path segment, whatever it holds


class GatewayClient:
    """Signed requests to one gateway; each answer is the decoded JSON (None for an empty 2xx body)."""

    def __init__(self, url: str, key: SigningKey, *, timeout_s: float,
                 transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self._key = key
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport, auth=HmacAuth(key))

    def close(self) -> None:
        self._http.close()

    def console_login_url(self, *, expires_ms: int) -> str:
        """The web console's single-use login link. The token sits in the fragment: browsers never send it, so no
        access log or proxy sees it."""
        if self._key.is_agent:
            raise CliError("the console login is signed with the operator key: use the gateway's key file",
                           exit_code=2)
        return f"{self.url}/console/login#token={login_token(self._key.key, expires_ms=expires_ms)}"

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        content = b"" if body is None else orjson.dumps(body)
        extra = {"content-type": "application/json"} if body is not None else {}
        extra.update(headers or {})
        try:
            resp = self._http.request(method, path, content=content, params=params, headers=extra)
        except httpx.TransportError as exc:
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise CliError(f"cannot reach the gateway at {self.url} ({detail})") from None
        if not resp.is_success:
            try:
                error = resp.json()["error"]
                code, message = str(error["code"]), str(error["message"])
            except (ValueError, KeyError, TypeError):
                code, message = "http_error", resp.text[:300] or resp.reason_phrase
            raise ErrorAnswer(resp.status_code, code, message)
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            raise CliError(f"{method} {path}: the {resp.status_code} answer is not JSON") from None
