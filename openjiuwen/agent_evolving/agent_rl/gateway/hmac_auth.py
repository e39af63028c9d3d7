"""HMAC-signed control requests (CONTRACT §3.2): the gateway's verification, with a skew window and per-key replay
caches. Signing lives in common/hmac_signing.py.

Two signature forms, both lowercase hex HMAC-SHA256 in `X-Signature` with `X-Timestamp` = Unix epoch milliseconds in
ASCII decimal:

- version 2 (`X-Signature-Version: 2`, what every client in this repository sends) signs the request itself:
  `"OJRL-HMAC-V2\\n" ‖ METHOD ‖ "\\n" ‖ TARGET ‖ "\\n" ‖ timestamp ‖ "\\n" ‖ body`, where TARGET is the request
  target as sent on the wire (the percent-encoded path, then `?` and the query string when there is one). A signed
  request therefore cannot be replayed on another route, method or query.
- the AIGW form (no version header, or `X-Signature-Version: 1`) signs `timestamp ‖ body` only; the gateway accepts
  it only when configured to (`global.acceptLegacySignatures`).

The two messages cannot collide (the AIGW one starts with a digit) and neither can a console login token or cookie
(console_auth.py: their own domain strings). The clock is an argument (`now_ms`), so every decision here is a pure
function of its inputs and the replay caches.
"""

from __future__ import annotations

import hashlib
import hmac
import heapq
import logging
import re
from collections.abc import Mapping

from ..common.hmac_signing import (
    CURRENT_VERSION,
    LEGACY_VERSION,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    VERSION_HEADER,
    v2_message,
)

log = logging.getLogger("openjiuwen.agent_rl.gateway.hmac")

SKEW_MS = 300_000
REPLAY_CAPACITY = 100_000  # per key: the api key's and the instance key's caches are separate
FULL_LOG_INTERVAL_MS = 60_000  # at most one "replay cache full" line per key per minute

_TIMESTAMP = re.compile(r"[0-9]{1,16}")  # ASCII digits only (str.isdigit would take '²' and other scripts)
_SIGNATURE = re.compile(r"[0-9a-f]{64}")  # lowercase hex, exactly one SHA-256
_METHOD = re.compile(r"[A-Z]{1,16}")


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
    """Verifies signed control requests with `api_key` (and, where allowed, `ins_key`).

    A request passes when the timestamp is ASCII decimal within ±`skew_ms` of `now_ms`, the signature matches
    (constant-time compare; version 2, or the AIGW form when `accept_legacy`) and the (timestamp, signature) pair has
    not been accepted before within the window. Only a correctly signed request enters a replay cache, so forgeries
    cannot fill one; and each key has its own cache, so no amount of instance-key traffic can make an operator's
    request be refused.

    The window's lower edge follows the latest clock reading seen: if the clock steps back, a timestamp older than
    that edge stays refused, because its replay-cache entry may already have been evicted.
    """

    def __init__(
        self,
        api_key: bytes,
        ins_key: bytes | None = None,
        *,
        skew_ms: int = SKEW_MS,
        replay_capacity: int = REPLAY_CAPACITY,
        accept_legacy: bool = False,
    ) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        if ins_key is not None and not ins_key:
            raise ValueError("ins_key must be None or non-empty")
        if skew_ms <= 0 or replay_capacity <= 0:
            raise ValueError("skew_ms and replay_capacity must be positive")
        self._api_key = api_key
        self._ins_key = ins_key
        self._skew_ms = skew_ms
        self._accept_legacy = accept_legacy
        self._api_replays = _ReplayCache("api", replay_capacity)
        self._ins_replays = _ReplayCache("instance", replay_capacity)
        self._latest_now_ms = 0

    def __repr__(self) -> str:  # never the keys
        return (f"HmacVerifier(skew_ms={self._skew_ms}, ins_key={'set' if self._ins_key else 'none'}, "
                f"accept_legacy={self._accept_legacy})")

    @property
    def replay_entries(self) -> int:
        """Live entries in both replay caches (for metrics and tests)."""
        return len(self._api_replays) + len(self._ins_replays)

    @property
    def replay_entries_by_key(self) -> dict[str, int]:
        return {"api": len(self._api_replays), "instance": len(self._ins_replays)}

    @property
    def replay_capacity_by_key(self) -> dict[str, int]:
        return {"api": self._api_replays.capacity, "instance": self._ins_replays.capacity}

    def verify_request(
        self, method: str, target: str | bytes, headers: Mapping[str, str], body: bytes, *, now_ms: int,
        allow_ins: bool = False,
    ) -> bool:
        """`verify` with the signature headers read from `headers` (Starlette's or httpx's case-insensitive headers,
        or a dict with lowercase names) and the request's method and target (path as sent, plus `?query`)."""

        def get(name: str) -> str | None:
            value = headers.get(name)
            return headers.get(name.lower()) if value is None else value

        return self.verify(
            get(TIMESTAMP_HEADER), body, get(SIGNATURE_HEADER), now_ms=now_ms, allow_ins=allow_ins,
            method=method, target=target, version=get(VERSION_HEADER),
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
    ) -> bool:
        """True when the request is authentic, fresh and not a replay; `allow_ins` also accepts `ins_key`
        (register-instance). `version` is the `X-Signature-Version` header: "2" needs `method` and `target`; None or
        "1" is the AIGW form, refused unless `accept_legacy`. Any missing or malformed input is simply False."""
        if timestamp is None or signature is None:
            return False
        if not _TIMESTAMP.fullmatch(timestamp) or not _SIGNATURE.fullmatch(signature):
            return False
        if version == CURRENT_VERSION:
            if method is None or target is None or not _METHOD.fullmatch(method):
                return False
            try:
                message = v2_message(method, target, timestamp, body)
            except UnicodeEncodeError:  # a target no request line could carry
                return False
        elif version in (None, LEGACY_VERSION) and self._accept_legacy:
            message = timestamp.encode("ascii") + body
        else:
            return False
        self._latest_now_ms = max(self._latest_now_ms, now_ms)
        self._api_replays.evict(self._latest_now_ms)
        self._ins_replays.evict(self._latest_now_ms)
        ts = int(timestamp)
        if ts > now_ms + self._skew_ms or ts < self._latest_now_ms - self._skew_ms:
            return False
        if _matches(self._api_key, message, signature):
            cache = self._api_replays
        elif allow_ins and self._ins_key is not None and _matches(self._ins_key, message, signature):
            cache = self._ins_replays
        else:
            return False
        # Needed while a request with this timestamp is still inside the window, i.e. up to ts + skew.
        return cache.first(timestamp, signature, expires_ms=ts + self._skew_ms, now_ms=now_ms)


def _matches(key: bytes, message: bytes, signature: str) -> bool:
    expected = hmac.new(key, message, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected.encode("ascii"), signature.encode("ascii"))
