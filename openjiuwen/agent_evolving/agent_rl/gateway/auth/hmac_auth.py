"""HMAC-signed control requests (CONTRACT §3.2): the gateway's verification, with a skew window, per-key replay
caches, and who signed. Signing lives in common/hmac_signing.py.

Three kinds of key sign requests: the operator key (`apiHmacKey`), the instance key (`insHmacKey`, register-instance
only) and agent keys (`agentHmacKeys`, each with an id). A successful verification answers the `Caller`; which
callers a route takes is the route's decision (routes/deps.py). Two signature forms, both lowercase hex HMAC-SHA256
in `X-Signature` with `X-Timestamp` = Unix epoch milliseconds in ASCII decimal:

- version 3 (`X-Signature-Version: 3`, what every client in this repository sends) signs the request and the headers
  that change its meaning: `"OJRL-HMAC-V3\\n" ‖ METHOD ‖ "\\n" ‖ TARGET ‖ "\\n" ‖ timestamp ‖ "\\n" ‖ key id ‖ "\\n" ‖
  session id ‖ "\\n" ‖ body`, where TARGET is the request target as sent on the wire (the percent-encoded path, then
  `?` and the query string when there is one), the key id is `X-Key-Id` (empty without one) and the session id is
  `X-Agent-Session-Id` as sent (empty without one). A signed request therefore cannot be replayed on another route,
  method or query, nor re-targeted to another session. A request naming an agent key (`X-Key-Id`) is checked against
  that key alone; any other against the operator key (and the instance key where the route allows it).
- the AIGW form (no version header, or `X-Signature-Version: 1`) signs `timestamp ‖ body` only; the gateway accepts
  it only when configured to (`global.acceptLegacySignatures`), and never with an agent key.

A signed header sent twice is refused: the signature must cover the one value the gateway acts on. The messages
cannot collide (the AIGW one starts with a digit) and neither can a console login token or cookie
(console/console_auth.py: their own domain strings). The clock is an argument (`now_ms`), so every decision here is a
pure function of its inputs and the replay caches.
"""

from __future__ import annotations

import hashlib
import hmac
import heapq
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from ...common.hmac_signing import (
    CURRENT_VERSION,
    KEY_ID_HEADER,
    LEGACY_VERSION,
    SESSION_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    VERSION_HEADER,
    v3_message,
)
from ...common.signing_keys import is_agent_key_id

if TYPE_CHECKING:
    from starlette.requests import Request

log = logging.getLogger("openjiuwen.agent_rl.gateway.hmac")

SKEW_MS = 300_000
REPLAY_CAPACITY = 100_000  # per key: the api key, the instance key and each agent key have their own cache
FULL_LOG_INTERVAL_MS = 60_000  # at most one "replay cache full" line per key per minute

_TIMESTAMP = re.compile(r"[0-9]{1,16}")  # ASCII digits only (str.isdigit would take '²' and other scripts)
_SIGNATURE = re.compile(r"[0-9a-f]{64}")  # lowercase hex, exactly one SHA-256
_METHOD = re.compile(r"[A-Z]{1,16}")
_SIGNED_HEADERS = (TIMESTAMP_HEADER, SIGNATURE_HEADER, VERSION_HEADER, KEY_ID_HEADER, SESSION_HEADER)


class KeyRole(StrEnum):
    OPERATOR = "operator"  # apiHmacKey
    INSTANCE = "instance"  # insHmacKey
    AGENT = "agent"  # one of agentHmacKeys


@dataclass(frozen=True, slots=True)
class Caller:
    """Who signed a request: the role of its key and, for an agent key, the key's id."""

    role: KeyRole
    agent_key_id: str | None = None


OPERATOR = Caller(KeyRole.OPERATOR)
INSTANCE = Caller(KeyRole.INSTANCE)


class _ReplayCache:
    """(timestamp, signature) pairs seen inside the window; each expires once its timestamp leaves the window.

    A min-heap ordered by expiry makes eviction O(log n) per expired entry. The size is capped: when the cache is
    full of live entries a new pair is refused (fail closed) rather than evicting one that could then be replayed.
    Refusals are logged at most once per `FULL_LOG_INTERVAL_MS`, with their count, never once per request.
    """

    def __init__(self, name: str, capacity: int) -> None:
        self._name = name
        self._capacity = capacity
        self._seen: set[tuple[str, str]] = set()
        self._expiry: list[tuple[int, str, str]] = []
        self._refused = 0  # since the last log line
        self._logged_ms: int | None = None

    def __len__(self) -> int:
        return len(self._seen)

    @property
    def capacity(self) -> int:
        return self._capacity

    def evict(self, now_ms: int) -> None:
        """Drop the pairs whose timestamp has left the window at `now_ms` (expiry = timestamp + skew)."""
        while self._expiry and self._expiry[0][0] < now_ms:
            _, timestamp, sig = heapq.heappop(self._expiry)
            self._seen.discard((timestamp, sig))

    def first(self, timestamp: str, sig: str, *, expires_ms: int, now_ms: int) -> bool:
        """True and remembered when the pair is new; False when it is a replay or the cache is full."""
        pair = (timestamp, sig)
        if pair in self._seen:
            return False
        if len(self._seen) >= self._capacity:
            self._note_full(now_ms)
            return False
        self._seen.add(pair)
        heapq.heappush(self._expiry, (expires_ms, timestamp, sig))
        return True

    def _note_full(self, now_ms: int) -> None:
        self._refused += 1
        if self._logged_ms is not None and now_ms - self._logged_ms < FULL_LOG_INTERVAL_MS:
            return
        log.warning("HMAC replay cache of the %s key full (%d live entries): refused %d signed request(s) with "
                    "that key since the last report; they pass again as entries expire", self._name,
                    self._capacity, self._refused)
        self._refused = 0
        self._logged_ms = now_ms


class HmacVerifier:
    """Verifies signed control requests with the operator key `api_key`, the instance key `ins_key` (where allowed)
    and the agent keys `agent_keys` (id → key).

    A request passes when the timestamp is ASCII decimal within ±`skew_ms` of `now_ms`, the signature matches
    (constant-time compare; version 3, or the AIGW form when `accept_legacy` and no agent key is named) and the
    (timestamp, signature) pair has not been accepted before within the window. Only a correctly signed request
    enters a replay cache, so forgeries cannot fill one; and each key has its own cache, so no amount of traffic
    signed with one key can make another key's request be refused.

    The window's lower edge follows the latest clock reading seen: if the clock steps back, a timestamp older than
    that edge stays refused, because its replay-cache entry may already have been evicted.
    """

    def __init__(
        self,
        api_key: bytes,
        ins_key: bytes | None = None,
        *,
        agent_keys: Mapping[str, bytes] | None = None,
        skew_ms: int = SKEW_MS,
        replay_capacity: int = REPLAY_CAPACITY,
        accept_legacy: bool = False,
    ) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        if ins_key is not None and not ins_key:
            raise ValueError("ins_key must be None or non-empty")
        agents = dict(agent_keys or {})
        if not all(is_agent_key_id(key_id) and key for key_id, key in agents.items()):
            raise ValueError("agent_keys must map valid key ids to non-empty keys")
        if skew_ms <= 0 or replay_capacity <= 0:
            raise ValueError("skew_ms and replay_capacity must be positive")
        self._api_key, self._ins_key, self._agent_keys = api_key, ins_key, agents  # one key per holder
        self._skew_ms = skew_ms
        self._accept_legacy = accept_legacy
        self._api_replays = _ReplayCache("api", replay_capacity)
        self._ins_replays = _ReplayCache("instance", replay_capacity)
        self._agent_replays = {key_id: _ReplayCache(f"agent {key_id!r}", replay_capacity) for key_id in agents}
        self._latest_now_ms = 0

    def __repr__(self) -> str:  # never the keys
        return (f"HmacVerifier(skew_ms={self._skew_ms}, ins_key={'set' if self._ins_key else 'none'}, "
                f"agent_keys={sorted(self._agent_keys)}, accept_legacy={self._accept_legacy})")

    def _caches(self) -> dict[str, _ReplayCache]:
        caches = {"api": self._api_replays, "instance": self._ins_replays}
        caches.update({f"agent:{key_id}": cache for key_id, cache in self._agent_replays.items()})
        return caches

    @property
    def replay_entries(self) -> int:
        """Live entries in every replay cache (for metrics and tests)."""
        return sum(len(cache) for cache in self._caches().values())

    def verify_request(
        self, method: str, target: str | bytes, headers: Mapping[str, str], body: bytes, *, now_ms: int,
        allow_ins: bool = False,
    ) -> Caller | None:
        """`verify` with the signed headers read from `headers` (Starlette's or httpx's case-insensitive headers, or
        a dict with lowercase names) and the request's method and target (path as sent, plus `?query`). A signed
        header sent more than once is refused."""
        values: dict[str, str | None] = {}
        for name in _SIGNED_HEADERS:
            found = _header_values(headers, name)
            if len(found) > 1:
                return None
            values[name] = found[0] if found else None
        session = values[SESSION_HEADER]
        try:
            session_bytes = b"" if session is None else session.encode("latin-1")  # the bytes as received
        except UnicodeEncodeError:
            return None
        return self.verify(
            values[TIMESTAMP_HEADER], body, values[SIGNATURE_HEADER], now_ms=now_ms, allow_ins=allow_ins,
            method=method, target=target, version=values[VERSION_HEADER], key_id=values[KEY_ID_HEADER],
            session_id=session_bytes,
        )

    def verify(
        self,
        timestamp: str | None,
        body: bytes,
        signature: str | None,
        *,
        now_ms: int,
        allow_ins: bool = False,
        method: str | None = None,
        target: str | bytes | None = None,
        version: str | None = None,
        key_id: str | None = None,
        session_id: bytes = b"",
    ) -> Caller | None:
        """The caller when the request is authentic, fresh and not a replay, else None. `key_id` (the `X-Key-Id`
        header) names the agent key to check, and no other; without it the api key is checked, and `allow_ins`
        also accepts `ins_key` (register-instance). `version` is the `X-Signature-Version` header: "3" needs
        `method` and `target`; None or "1" is the AIGW form, refused unless `accept_legacy`, and always with an
        agent key. Any missing, unknown or malformed input is simply None."""
        if timestamp is None or signature is None:
            return None
        if not _TIMESTAMP.fullmatch(timestamp) or not _SIGNATURE.fullmatch(signature):
            return None
        if key_id is not None and key_id not in self._agent_keys:
            return None
        if version == CURRENT_VERSION:
            if method is None or target is None or not _METHOD.fullmatch(method):
                return None
            try:
                message = v3_message(method, target, timestamp, body, key_id=key_id or b"", session_id=session_id)
            except UnicodeEncodeError:  # a target no request line could carry
                return None
        elif version in (None, LEGACY_VERSION) and self._accept_legacy and key_id is None:
            message = timestamp.encode("ascii") + body
        else:
            return None
        self._latest_now_ms = max(self._latest_now_ms, now_ms)
        for cache in self._caches().values():
            cache.evict(self._latest_now_ms)
        ts = int(timestamp)
        if ts > now_ms + self._skew_ms or ts < self._latest_now_ms - self._skew_ms:
            return None
        if key_id is not None:
            if not _matches(self._agent_keys[key_id], message, signature):
                return None
            caller, cache = Caller(KeyRole.AGENT, key_id), self._agent_replays[key_id]
        elif _matches(self._api_key, message, signature):
            caller, cache = OPERATOR, self._api_replays
        elif allow_ins and self._ins_key is not None and _matches(self._ins_key, message, signature):
            caller, cache = INSTANCE, self._ins_replays
        else:
            return None
        # Needed while a request with this timestamp is still inside the window, i.e. up to ts + skew.
        if not cache.first(timestamp, signature, expires_ms=ts + self._skew_ms, now_ms=now_ms):
            return None
        return caller


def request_target(request: Request) -> bytes:
    """The request target as it arrived (percent-encoded path, then `?query` when there is one): what a signature
    covers."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string") or b""
    return raw + b"?" + query if query else raw


def _header_values(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of header `name`: Starlette's `getlist`, httpx's `get_list`, else one value of a plain mapping."""
    for method in ("getlist", "get_list"):
        getter = getattr(headers, method, None)
        if getter is not None:
            return list(getter(name))
    value = headers.get(name)
    value = headers.get(name.lower()) if value is None else value
    return [] if value is None else [value]


def _matches(key: bytes, message: bytes, signature: str) -> bool:
    expected = hmac.new(key, message, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected.encode("ascii"), signature.encode("ascii"))
