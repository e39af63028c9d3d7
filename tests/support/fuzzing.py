"""Helpers shared by the fuzzing tests: a Redis snapshot of the service's keys, and the answer check."""

from __future__ import annotations

import orjson
from redis import Redis as SyncRedis

PREFIX = "rl:v1:*"  # every key the service writes; nothing else is touched


class RedisSnapshot:
    """DUMP/RESTORE of the `rl:v1:` keys, so every fuzzing example starts from the same seeded state."""

    def __init__(self, redis: SyncRedis) -> None:
        self.redis = redis
        self._saved: list[tuple[bytes, int, bytes]] = []

    def clear(self) -> None:
        for key in self.redis.scan_iter(match=PREFIX):
            self.redis.delete(key)

    def take(self) -> None:
        self._saved = [(k, max(self.redis.pttl(k), 0), self.redis.dump(k)) for k in self.redis.scan_iter(match=PREFIX)]

    def restore(self) -> None:
        # One MULTI: the service never sees a half-restored state between two requests.
        pipe = self.redis.pipeline(transaction=True)
        for key in self.redis.scan_iter(match=PREFIX):
            pipe.delete(key)
        for key, ttl, value in self._saved:
            pipe.restore(key, ttl, value, replace=True)
        pipe.execute()


def assert_envelope(status: int, content: bytes, where: str, *, content_type: str = "application/json",
                    upstream: bool = False) -> None:
    """Never a 5xx; a 204 is empty; every other error is exactly `{"error": {"code": str, "message": str}}`; a
    success is a JSON object (or an event stream, whose events the fuzzing client may not read to the end).

    `upstream`: an inference route, where vLLM's own error body passes through unchanged (CONTRACT §3.5): then the
    error object may carry vLLM's fields (`message`, `type`, `param`, integer `code`)."""
    assert status < 500, f"{status} {content[:300]!r} for {where}"
    if status == 204:
        assert content == b"", where
        return
    if status < 300 and content_type.startswith("text/event-stream"):
        return
    body = orjson.loads(content)
    if status >= 300:
        assert isinstance(body, dict) and set(body) == {"error"}, where
        error = body["error"]
        if upstream and isinstance(error, dict) and "type" in error:
            assert isinstance(error.get("message"), str) and error.get("code") == status, where
            return
        assert isinstance(error, dict) and set(error) == {"code", "message"}, where
        assert isinstance(error["code"], str) and isinstance(error["message"], str), where
    else:
        assert isinstance(body, dict), where
