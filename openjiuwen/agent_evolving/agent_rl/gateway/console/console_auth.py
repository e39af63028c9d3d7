"""Web console authentication: a short-lived login token signed with the gateway's `apiHmacKey`, exchanged once for a
signed session cookie.

    token  = "<expires_ms>.<hex HMAC(api_key, LOGIN_DOMAIN ‖ expires_ms)>"          (`openjiuwen-rl rl console url`)
    cookie = "<expires_ms>.<nonce>.<hex HMAC(api_key, SESSION_DOMAIN ‖ expires_ms.nonce)>"

Each message starts with its own domain string, so no signed control request, login token or cookie can stand in for
another. A token is accepted once (it may sit in a shell history) and only when its expiry is at most
`MAX_LOGIN_TTL_MS` ahead. A cookie carries its own expiry and is checked against it here (Max-Age alone is a client
hint). Rotating `apiHmacKey` revokes every token and session. The clock is an argument, as in `hmac_auth`.
"""

from __future__ import annotations

import hashlib
import hmac
import heapq
import re
import secrets

LOGIN_DOMAIN = b"openjiuwen-rl console login\n"
SESSION_DOMAIN = b"openjiuwen-rl console session\n"
COOKIE_NAME = "ojrl_console"
DEFAULT_LOGIN_TTL_S = 600
MAX_LOGIN_TTL_MS = 24 * 3600 * 1000  # a token promising a longer life is refused: it would be a standing password
SESSION_TTL_MS = 8 * 3600 * 1000
USED_TOKEN_CAPACITY = 10_000

_TOKEN = re.compile(r"([0-9]{1,16})\.([0-9a-f]{64})")
_COOKIE = re.compile(r"([0-9]{1,16})\.([0-9a-f]{32})\.([0-9a-f]{64})")


def _mac(key: bytes, domain: bytes, message: str) -> str:
    return hmac.new(key, domain + message.encode("ascii"), hashlib.sha256).hexdigest()


def login_token(key: bytes, *, expires_ms: int) -> str:
    """The login token valid until `expires_ms` (Unix epoch milliseconds)."""
    return f"{int(expires_ms)}.{_mac(key, LOGIN_DOMAIN, str(int(expires_ms)))}"


class ConsoleAuth:
    """Verifies login tokens (each once) and issues and verifies session cookies."""

    def __init__(self, api_key: bytes, *, session_ttl_ms: int = SESSION_TTL_MS,
                 used_capacity: int = USED_TOKEN_CAPACITY) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        if session_ttl_ms <= 0 or used_capacity <= 0:
            raise ValueError("session_ttl_ms and used_capacity must be positive")
        self._key = api_key
        self._session_ttl_ms = session_ttl_ms
        self._capacity = used_capacity
        self._used: set[str] = set()
        self._expiry: list[tuple[int, str]] = []

    def __repr__(self) -> str:  # never the key
        return f"ConsoleAuth(session_ttl_ms={self._session_ttl_ms})"

    @property
    def session_ttl_ms(self) -> int:
        return self._session_ttl_ms

    def redeem(self, token: object, *, now_ms: int) -> bool:
        """True once for an authentic, unexpired token; a second redemption, a forgery or junk is False."""
        if not isinstance(token, str):
            return False
        match = _TOKEN.fullmatch(token)
        if match is None:
            return False
        expires_ms = int(match.group(1))
        if not now_ms < expires_ms <= now_ms + MAX_LOGIN_TTL_MS:
            return False
        expected = _mac(self._key, LOGIN_DOMAIN, match.group(1))
        if not hmac.compare_digest(expected.encode("ascii"), match.group(2).encode("ascii")):
            return False
        while self._expiry and self._expiry[0][0] <= now_ms:  # expired tokens are refused anyway: forget them
            self._used.discard(heapq.heappop(self._expiry)[1])
        if token in self._used or len(self._used) >= self._capacity:
            return False  # a replay, or (fail closed) too many live tokens to remember
        self._used.add(token)
        heapq.heappush(self._expiry, (expires_ms, token))
        return True

    def issue(self, *, now_ms: int) -> tuple[str, int]:
        """A new session cookie value and its lifetime in seconds."""
        expires = str(int(now_ms) + self._session_ttl_ms)
        nonce = secrets.token_hex(16)
        value = f"{expires}.{nonce}.{_mac(self._key, SESSION_DOMAIN, f'{expires}.{nonce}')}"
        return value, self._session_ttl_ms // 1000

    def session_ok(self, cookie: str | None, *, now_ms: int) -> bool:
        """True when the cookie is one this gateway issued and it has not expired."""
        if not cookie:
            return False
        match = _COOKIE.fullmatch(cookie)
        if match is None or int(match.group(1)) <= now_ms:
            return False
        expected = _mac(self._key, SESSION_DOMAIN, f"{match.group(1)}.{match.group(2)}")
        return hmac.compare_digest(expected.encode("ascii"), match.group(3).encode("ascii"))
