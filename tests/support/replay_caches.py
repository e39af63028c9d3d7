"""What `HmacVerifier`'s replay caches hold, per key, for tests of their separation and size."""

from __future__ import annotations

from openjiuwen.agent_evolving.agent_rl.gateway.auth.hmac_auth import HmacVerifier


def replay_entries_by_key(verifier: HmacVerifier) -> dict[str, int]:
    return {name: len(cache) for name, cache in verifier._caches().items()}  # noqa: SLF001


def replay_capacity_by_key(verifier: HmacVerifier) -> dict[str, int]:
    return {name: cache.capacity for name, cache in verifier._caches().items()}  # noqa: SLF001
