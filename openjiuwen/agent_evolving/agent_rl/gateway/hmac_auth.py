"""HMAC-signed control requests (CONTRACT §3.2): verification with a skew window and a replay cache, and signing.

`X-Timestamp` is Unix epoch milliseconds in decimal; `X-Signature` is lowercase hex HMAC-SHA256(key, ASCII
timestamp ‖ raw body bytes), the body part empty for bodiless requests. Method and path are not signed. The clock is
an argument (`now_ms`), so every decision here is a pure function of its inputs and the replay cache.
"""

from __future__ import annotations

import hashlib
import hmac
import heapq
import logging
import re

log = logging.getLogger("openjiuwen.agent_rl.gateway.hmac")

TIMESTAMP_HEADER = "X-Timestamp"
SIGNATURE_HEADER = "X-Signature"
SKEW_MS = 300_000
REPLAY_CAPACITY = 100_000

_TIMESTAMP = re.compile(r"[0-9]{1,16}")  # ASCII digits only (str.isdigit would take '²' and other scripts)
_SIGNATURE = re.compile(r"[0-9a-f]{64}")  # lowercase hex, exactly one SHA-256


def signature(key: bytes, timestamp: str, body: bytes) -> str:
    """Lowercase hex HMAC-SHA256(key, ASCII timestamp ‖ body)."""
    return hmac.new(key, timestamp.encode("ascii") + body, hashlib.sha256).hexdigest()


def sign(key: bytes, body: bytes, *, now_ms: int) -> dict[str, str]:
    """The two headers of a signed request carrying `body` (b"" when the request has none)."""
    timestamp = str(int(now_ms))
    return {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: signature(key, timestamp, body)}


class _ReplayCache:
    """(timestamp, signature) pairs seen inside the window; each expires once its timestamp leaves the window.

    A min-heap ordered by expiry makes eviction O(log n) per expired entry. The size is capped: when the cache is
    full of live entries a new pair is refused (fail closed) rather than evicting one that could then be replayed.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._seen: set[tuple[str, str]] = set()
        self._expiry: list[tuple[int, str, str]] = []

    def __len__(self) -> int:
        return len(self._seen)

    def evict(self, now_ms: int) -> None:
        """Drop the pairs whose timestamp has left the window at `now_ms` (expiry = timestamp + skew)."""
        while self._expiry and self._expiry[0][0] < now_ms:
            _, timestamp, sig = heapq.heappop(self._expiry)
            self._seen.discard((timestamp, sig))

    def first(self, timestamp: str, sig: str, *, expires_ms: int) -> bool:
        """True and remembered when the pair is new; False when it is a replay or the cache is full."""
        pair = (timestamp, sig)
        if pair in self._seen:
            return False
        if len(self._seen) >= self._capacity:
            log.warning("HMAC replay cache full (%d live entries); refusing signed requests until some expire",
                        self._capacity)
            return False
        self._seen.add(pair)
        heapq.heappush(self._expiry, (expires_ms, timestamp, sig))
        return True


class HmacVerifier:
    """Verifies signed control requests with `api_key` (and, where allowed, `ins_key`).

    A request passes when the timestamp is ASCII decimal within ±`skew_ms` of `now_ms`, the signature matches
    (constant-time compare) and the (timestamp, signature) pair has not been accepted before within the window.
    Only a correctly signed request enters the replay cache, so forgeries cannot fill it.

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
        self._replays = _ReplayCache(replay_capacity)
        self._latest_now_ms = 0

    def __repr__(self) -> str:  # never the keys
        return f"HmacVerifier(skew_ms={self._skew_ms}, ins_key={'set' if self._ins_key else 'none'})"

    @property
    def replay_entries(self) -> int:
        """Live entries in the replay cache (for metrics and tests)."""
        return len(self._replays)

    def verify(
        self,
        timestamp: str | None,
        body: bytes,
        signature: str | None,
        *,
        now_ms: int,
        allow_ins: bool = False,
    ) -> bool:
        """True when the request is authentic, fresh and not a replay; `allow_ins` also accepts `ins_key`
        (register-instance). Any missing or malformed input is simply False."""
        if timestamp is None or signature is None:
            return False
        if not _TIMESTAMP.fullmatch(timestamp) or not _SIGNATURE.fullmatch(signature):
            return False
        self._latest_now_ms = max(self._latest_now_ms, now_ms)
        self._replays.evict(self._latest_now_ms)
        ts = int(timestamp)
        if ts > now_ms + self._skew_ms or ts < self._latest_now_ms - self._skew_ms:
            return False
        message = timestamp.encode("ascii") + body
        expected = hmac.new(self._api_key, message, hashlib.sha256).hexdigest()
        ok = hmac.compare_digest(expected.encode("ascii"), signature.encode("ascii"))
        if allow_ins and self._ins_key is not None:
            expected_ins = hmac.new(self._ins_key, message, hashlib.sha256).hexdigest()
            ok = hmac.compare_digest(expected_ins.encode("ascii"), signature.encode("ascii")) or ok
        if not ok:
            return False
        # Needed while a request with this timestamp is still inside the window, i.e. up to ts + skew.
        return self._replays.first(timestamp, signature, expires_ms=ts + self._skew_ms)
