"""A line's sample counters (CONTRACT §2.7): read in O(1) from the transactional stats hash, never a scan."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from redis.asyncio import Redis

from ...common import ids
from . import keys
from .codec import text
from .sample_line import SampleLine
from .sample_status import SAMPLE_STATUSES, SampleStatus


def stale_pending(
    counters: Mapping[str, int], *, model_id: str, current_version: int, max_policy_lag: int | None
) -> int:
    """Pending samples whose policy lags `current_version` by more than `max_policy_lag` (none without a limit),
    counted from the per-version pending counters in O(number of versions)."""
    if max_policy_lag is None:
        return 0
    prefix = keys.STATS_PENDING_POLICY_PREFIX
    return sum(
        n for name, n in counters.items()
        if name.startswith(prefix) and n > 0
        and current_version - ids.policy_lag_version(name[len(prefix):], model_id) > max_policy_lag
    )


class SampleStats:
    def __init__(self, redis: Redis, *, max_policy_lag: int | None = None) -> None:
        self._redis = redis
        self._max_policy_lag = max_policy_lag

    async def stats(self, line: SampleLine) -> dict[str, Any]:
        """CONTRACT §2.7 counters of `line`: one HGETALL and one GET, whatever the number of samples."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(line.stats_key)
            pipe.get(keys.POLICY_OBSERVED)
            raw_counters, raw_observed = await pipe.execute()
        counters = {text(k) or "": max(0, int(v)) for k, v in raw_counters.items()}
        # `awaiting_rewards` is shown under a reward policy, or while samples still wait from one (else the shape
        # stays that of CONTRACT §2.7).
        # `evaluation` and `excluded` likewise appear once such samples are stored, so `total` counts them too.
        waiting = counters.get(keys.stats_status(SampleStatus.AWAITING_REWARDS), 0) > 0
        shown = [*((SampleStatus.AWAITING_REWARDS,) if line.reward_policy is not None or waiting else ()),
                 *SAMPLE_STATUSES]
        for optional in (SampleStatus.EVALUATION, SampleStatus.EXCLUDED, SampleStatus.OUTDATED):
            if counters.get(keys.stats_status(optional), 0) > 0:
                shown.append(optional)
        by_status = {status.value: counters.get(keys.stats_status(status), 0) for status in shown}
        by_source = {
            name[len("source:"):]: n for name, n in sorted(counters.items()) if name.startswith("source:") and n > 0
        }
        return {
            "total": sum(by_status.values()),
            "by_status": by_status,
            "by_source": by_source,
            "stale": self._stale(line, counters, raw_observed),
            "expired_unrewarded": counters.get("expired_unrewarded", 0),
            "updated_at": ids.now_iso(),
        }

    def _stale(self, line: SampleLine, counters: dict[str, int], raw_observed: bytes | None) -> int:
        if self._max_policy_lag is None or raw_observed is None:
            return 0
        try:
            observed = orjson.loads(raw_observed)
        except orjson.JSONDecodeError:
            return 0
        name = observed.get("lora_name") if isinstance(observed, dict) else None
        if not isinstance(name, str):
            return 0
        return stale_pending(
            counters, model_id=line.model_id, current_version=ids.policy_lag_version(name, line.model_id),
            max_policy_lag=self._max_policy_lag,
        )
