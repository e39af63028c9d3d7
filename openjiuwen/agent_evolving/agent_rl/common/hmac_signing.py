"""Signing of HMAC-signed control requests (CONTRACT §3.2): the one signer and the httpx auth every client uses.

Version 3 (`X-Signature-Version: 3`, what every client in this repository sends) signs the request itself and the
headers that change its meaning:
`"OJRL-HMAC-V3\\n" ‖ METHOD ‖ "\\n" ‖ TARGET ‖ "\\n" ‖ timestamp ‖ "\\n" ‖ key id ‖ "\\n" ‖ session id ‖ "\\n" ‖ body`,
where TARGET is the request target as sent on the wire (the percent-encoded path, then `?` and the query string when
there is one), the key id is the `X-Key-Id` header (an agent key's id; empty for the operator key) and the session id
the `X-Agent-Session-Id` header as sent (empty when absent). A signed request therefore cannot be replayed on another
route, method or query, nor re-targeted to another session or key. Header values cannot hold a line feed, so the
fields cannot run into each other. Version 2 (method, target and body only) is no longer accepted: it left the
session of a Task start unsigned. The AIGW form signs `timestamp ‖ body` only (`sign`). The gateway's verification
(skew window, replay caches) lives in gateway/auth/hmac_auth.py.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Generator

import httpx

from .signing_keys import SigningKey

TIMESTAMP_HEADER = "X-Timestamp"
SIGNATURE_HEADER = "X-Signature"
VERSION_HEADER = "X-Signature-Version"
KEY_ID_HEADER = "X-Key-Id"
SESSION_HEADER = "X-Agent-Session-Id"
CURRENT_VERSION = "3"
LEGACY_VERSION = "1"
V3_DOMAIN = b"OJRL-HMAC-V3\n"


def _ascii(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("ascii")


def v3_message(method: str, target: str | bytes, timestamp: str, body: bytes, *, key_id: str | bytes = b"",
               session_id: bytes = b"") -> bytes:
    """The bytes a version-3 signature covers (module docstring). `session_id` is the header's bytes as sent."""
    return b"".join((V3_DOMAIN, method.encode("ascii"), b"\n", _ascii(target), b"\n", timestamp.encode("ascii"),
                     b"\n", _ascii(key_id), b"\n", session_id, b"\n", body))


def signature(key: bytes, timestamp: str, body: bytes) -> str:
    """The AIGW form: lowercase hex HMAC-SHA256(key, ASCII timestamp ‖ body)."""
    return hmac.new(key, timestamp.encode("ascii") + body, hashlib.sha256).hexdigest()


def sign(key: bytes, body: bytes, *, now_ms: int) -> dict[str, str]:
    """The two headers of an AIGW-form signed request carrying `body` (b"" when the request has none). Only for
    talking to a gateway that accepts the AIGW form; this repository's clients use `sign_request`."""
    timestamp = str(int(now_ms))
    return {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: signature(key, timestamp, body)}


def sign_request(key: bytes, method: str, target: str | bytes, body: bytes, *, now_ms: int,
                 key_id: str | None = None, session_id: str | bytes | None = None) -> dict[str, str]:
    """The headers of a version-3 signed request: `target` is the path as sent (percent-encoded) plus `?query` when
    there is one, e.g. `httpx.Request.url.raw_path`; `body` the exact bytes sent (b"" for none); `key_id` the agent
    key's id (None for the operator key: no `X-Key-Id` is sent); `session_id` the `X-Agent-Session-Id` the request
    carries (None when it carries none; as text, the Latin-1 bytes HTTP/1.1 clients send for it). The caller sends
    that session header itself; `X-Key-Id` is returned here."""
    timestamp = str(int(now_ms))
    session = session_id.encode("latin-1") if isinstance(session_id, str) else session_id or b""
    mac = hmac.new(key, v3_message(method.upper(), target, timestamp, body, key_id=key_id or b"",
                                   session_id=session), hashlib.sha256).hexdigest()
    headers = {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: mac, VERSION_HEADER: CURRENT_VERSION}
    if key_id is not None:
        headers[KEY_ID_HEADER] = key_id
    return headers


class RequestSigner:
    """Signs requests with one key and strictly increasing timestamps: two identical requests in one millisecond
    would otherwise carry the same (timestamp, signature) pair, and the gateway refuses the second as a replay.
    The one place this repository's clients sign (operator CLI, `call`, the demo, rail uploads, tests)."""

    def __init__(self, key: bytes | SigningKey, *, key_id: str | None = None) -> None:
        if isinstance(key, SigningKey):
            key, key_id = key.key, key.key_id
        if not key:
            raise ValueError("key must not be empty")
        self._key = key
        self._key_id = key_id
        self._last_ms = 0
        self._lock = threading.Lock()  # clients share one signer across threads (the demo does)

    def __repr__(self) -> str:  # never the key
        return f"RequestSigner(key_id={self._key_id!r})"

    def headers(self, method: str, target: str | bytes, body: bytes = b"", *,
                session_id: str | bytes | None = None) -> dict[str, str]:
        with self._lock:
            self._last_ms = now_ms = max(time.time_ns() // 1_000_000, self._last_ms + 1)
        return sign_request(self._key, method, target, body, now_ms=now_ms, key_id=self._key_id,
                            session_id=session_id)

    def sign_httpx(self, request: httpx.Request) -> httpx.Request:
        """Add the signature headers to a built (not yet sent) httpx request, over its exact target, session header
        (the bytes httpx will send) and body."""
        sessions = [value for name, value in request.headers.raw if name.lower() == SESSION_HEADER.lower().encode()]
        if len(sessions) > 1:
            raise ValueError("a signed request carries at most one X-Agent-Session-Id")  # the gateway refuses more
        request.headers.update(self.headers(request.method, request.url.raw_path, request.read(),
                                            session_id=sessions[0] if sessions else None))
        return request


class HmacAuth(httpx.Auth):
    """httpx authentication that signs each request over its exact method, target, session and body as sent: one
    signed client for every caller (`httpx.Client(auth=HmacAuth(key))`, or `auth=` per request on a shared client).
    `key` is the operator key's bytes, a `SigningKey` (operator or agent) or a `RequestSigner`."""

    requires_request_body = True

    def __init__(self, key: bytes | SigningKey | RequestSigner) -> None:
        self.signer = key if isinstance(key, RequestSigner) else RequestSigner(key)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        yield self.signer.sign_httpx(request)
