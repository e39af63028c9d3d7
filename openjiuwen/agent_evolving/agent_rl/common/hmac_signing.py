"""Signing of HMAC-signed control requests (CONTRACT §3.2): the one signer and the httpx auth every client uses.

Version 2 (`X-Signature-Version: 2`, what every client in this repository sends) signs the request itself:
`"OJRL-HMAC-V2\\n" ‖ METHOD ‖ "\\n" ‖ TARGET ‖ "\\n" ‖ timestamp ‖ "\\n" ‖ body`, where TARGET is the request target as
sent on the wire (the percent-encoded path, then `?` and the query string when there is one), so a signed request
cannot be replayed on another route, method or query. The AIGW form signs `timestamp ‖ body` only (`sign`). The
gateway's verification (skew window, replay caches) lives in gateway/hmac_auth.py.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Generator

import httpx

TIMESTAMP_HEADER = "X-Timestamp"
SIGNATURE_HEADER = "X-Signature"
VERSION_HEADER = "X-Signature-Version"
CURRENT_VERSION = "2"
LEGACY_VERSION = "1"
V2_DOMAIN = b"OJRL-HMAC-V2\n"



def _target_bytes(target: str | bytes) -> bytes:
    return target if isinstance(target, bytes) else target.encode("ascii")


def v2_message(method: str, target: str | bytes, timestamp: str, body: bytes) -> bytes:
    """The bytes a version-2 signature covers (module docstring)."""
    return b"".join((V2_DOMAIN, method.encode("ascii"), b"\n", _target_bytes(target), b"\n",
                     timestamp.encode("ascii"), b"\n", body))


def signature(key: bytes, timestamp: str, body: bytes) -> str:
    """The AIGW form: lowercase hex HMAC-SHA256(key, ASCII timestamp ‖ body)."""
    return hmac.new(key, timestamp.encode("ascii") + body, hashlib.sha256).hexdigest()


def sign(key: bytes, body: bytes, *, now_ms: int) -> dict[str, str]:
    """The two headers of an AIGW-form signed request carrying `body` (b"" when the request has none). Only for
    talking to a gateway that accepts the AIGW form; this repository's clients use `sign_request`."""
    timestamp = str(int(now_ms))
    return {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: signature(key, timestamp, body)}


def sign_request(key: bytes, method: str, target: str | bytes, body: bytes, *, now_ms: int) -> dict[str, str]:
    """The three headers of a version-2 signed request: `target` is the path as sent (percent-encoded) plus `?query`
    when there is one, e.g. `httpx.Request.url.raw_path`; `body` the exact bytes sent (b"" for none)."""
    timestamp = str(int(now_ms))
    mac = hmac.new(key, v2_message(method.upper(), target, timestamp, body), hashlib.sha256).hexdigest()
    return {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: mac, VERSION_HEADER: CURRENT_VERSION}


class RequestSigner:
    """Signs requests with one key and strictly increasing timestamps: two identical requests in one millisecond
    would otherwise carry the same (timestamp, signature) pair, and the gateway refuses the second as a replay.
    The one place this repository's clients sign (operator CLI, `call`, the demo, rail uploads, tests)."""

    def __init__(self, key: bytes) -> None:
        if not key:
            raise ValueError("key must not be empty")
        self._key = key
        self._last_ms = 0
        self._lock = threading.Lock()  # clients share one signer across threads (the demo does)

    def __repr__(self) -> str:  # never the key
        return "RequestSigner()"

    def headers(self, method: str, target: str | bytes, body: bytes = b"") -> dict[str, str]:
        with self._lock:
            self._last_ms = now_ms = max(time.time_ns() // 1_000_000, self._last_ms + 1)
        return sign_request(self._key, method, target, body, now_ms=now_ms)

    def sign_httpx(self, request: httpx.Request) -> httpx.Request:
        """Add the signature headers to a built (not yet sent) httpx request, over its exact target and body."""
        request.headers.update(self.headers(request.method, request.url.raw_path, request.read()))
        return request


class HmacAuth(httpx.Auth):
    """httpx authentication that signs each request over its exact method, target and body as sent: one signed
    client for every caller (`httpx.Client(auth=HmacAuth(key))`, or `auth=` per request on a shared client)."""

    requires_request_body = True

    def __init__(self, key: bytes | RequestSigner) -> None:
        self.signer = key if isinstance(key, RequestSigner) else RequestSigner(key)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        yield self.signer.sign_httpx(request)
