"""Per-version evaluation (`GET /v1/rl/policies`): each policy version's Tasks, samples, reward with a 95 %
confidence interval, reward sources, judge agreement, tokens per completion and completion latency, plus the
comparison of the latest version with its parent — all from the incremental aggregates of `store/policy_stats.py`,
in O(number of versions)."""

from __future__ import annotations

import math
from typing import Any

from redis.asyncio import Redis

from ..common.ids import lora_version
from ..common.lineage import line_of, version_of
from ..common.policy_names import BASE_POLICY
from .store import keys
from .store.codec import text
from .store.policy_stats import LATENCY_BOUNDS_MS

# Two-sided 95 % Student t quantiles for 1..30 degrees of freedom; beyond that the normal 1.96.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)


def t95(df: int) -> float:
    return _T95[df - 1] if 1 <= df <= len(_T95) else 1.96


def _mean_var(n: int, total: float, squares: float) -> tuple[float, float]:
    """Mean and unbiased sample variance from n, Σx, Σx² (variance clamped at 0 against rounding)."""
    mean = total / n
    var = max(0.0, (squares - n * mean * mean) / (n - 1)) if n >= 2 else 0.0
    return mean, var


def welch_delta(a: tuple[int, float, float], b: tuple[int, float, float]) -> tuple[float, list[float] | None]:
    """Mean of a − mean of b, from (n, Σx, Σx²) each, with a Welch 95 % interval (t with min(n) − 1 degrees of
    freedom: conservative for small samples); the interval is None unless both have n ≥ 2."""
    mean_a, var_a = _mean_var(*a)
    mean_b, var_b = _mean_var(*b)
    delta = mean_a - mean_b
    if a[0] < 2 or b[0] < 2:
        return delta, None
    half = t95(min(a[0], b[0]) - 1) * math.sqrt(var_a / a[0] + var_b / b[0])
    return delta, [delta - half, delta + half]


def reward_summary(n: int, total: float, squares: float) -> dict[str, Any]:
    if n <= 0:
        return {"n": 0, "mean": None, "ci95": None}
    mean, var = _mean_var(n, total, squares)
    if n < 2:
        return {"n": n, "mean": mean, "ci95": None}
    half = t95(n - 1) * math.sqrt(var / n)
    return {"n": n, "mean": mean, "ci95": [mean - half, mean + half]}


def quantile_ms(buckets: dict[str, int], q: float) -> float | None:
    """The q-quantile of a latency histogram, linearly interpolated inside its bucket (the last finite bound when
    it falls in the +Inf bucket)."""
    total = sum(buckets.values())
    if total <= 0:
        return None
    rank, seen, lower = q * total, 0, 0.0
    for bound in LATENCY_BOUNDS_MS:
        count = buckets.get(str(bound), 0)
        if count and seen + count >= rank:
            return lower + (bound - lower) * max(0.0, rank - seen) / count
        seen += count
        lower = float(bound)
    return float(LATENCY_BOUNDS_MS[-1])


class PolicyReport:
    def __init__(self, redis: Redis, *, model_id: str) -> None:
        self._redis = redis
        self._model_id = model_id

    async def report(self, *, lineage: str | None = None) -> dict[str, Any]:
        """Every version; with `lineage`, `base` (where every line starts: its aggregates are every lineage's) and
        the versions of that lineage's line only, numbered per line (docs/lineages.md)."""
        names = [text(v) or "" for v in await self._redis.smembers(keys.POLICY_VERSIONS)]
        if lineage is None:
            versions = sorted(names, key=lambda name: (lora_version(name, self._model_id) or 0, name != BASE_POLICY,
                                                       name))
        else:
            line = line_of(self._model_id, lineage)
            versions = sorted((name for name in names if name == BASE_POLICY or version_of(name, line) is not None),
                              key=lambda name: version_of(name, line) or 0)
        if not versions:
            return {"items": [], "comparison": None}
        async with self._redis.pipeline(transaction=False) as pipe:
            for version in versions:
                pipe.hgetall(keys.policy_stats(version))
            hashes = await pipe.execute()
        stats = {v: {text(k) or "": text(x) or "" for k, x in h.items()} for v, h in zip(versions, hashes)}
        items = [self._item(version, stats[version]) for version in versions]
        return {"items": items, "comparison": self._comparison(items, stats)}

    def _item(self, version: str, h: dict[str, str]) -> dict[str, Any]:
        def num(name: str) -> float:
            try:
                return float(h.get(name) or 0)
            except ValueError:
                return 0.0

        samples = int(num("samples"))
        reward_n = int(num("reward_n"))
        judge_multi = int(num("judge_multi"))
        lat_n = int(num("lat_n"))
        buckets = {name[len("lat_le:"):]: int(num(name)) for name in h if name.startswith("lat_le:")}
        latency = None
        if lat_n > 0:
            latency = {
                "mean": num("lat_sum_ms") / lat_n,
                "p50": quantile_ms(buckets, 0.5),
                "p95": quantile_ms(buckets, 0.95),
            }
        return {
            "policy_version": version,
            "lora_name": None if version == BASE_POLICY else version,
            "parent_version": h.get("parent") or None,
            "tasks": int(num("tasks")),
            "samples": samples,
            "reward": reward_summary(reward_n, num("reward_sum"), num("reward_sq")),
            "reward_sources": {
                name[len("source:"):]: int(num(name))
                for name in sorted(h) if name.startswith("source:") and int(num(name)) > 0
            },
            "judge_agreement": (1.0 - num("judge_spread") / judge_multi) if judge_multi > 0 else None,
            "tokens_per_completion": (num("tokens") / samples) if samples > 0 else None,
            "completion_latency_ms": latency,
            # Evaluation Tasks alone (never trained on): the held-out measure of this version.
            "evaluation": {
                "tasks": int(num("eval_tasks")),
                "samples": int(num("eval_samples")),
                "reward": reward_summary(int(num("eval_reward_n")), num("eval_reward_sum"), num("eval_reward_sq")),
            },
        }

    @staticmethod
    def _comparison(items: list[dict[str, Any]], stats: dict[str, dict[str, str]]) -> dict[str, Any] | None:
        """The newest version with rewarded samples whose parent has rewarded samples too, against that parent:
        difference of mean rewards with a Welch 95 % interval (t with min(n) − 1 degrees of freedom)."""
        by_version = {item["policy_version"]: item for item in items}
        for item in reversed(items):
            parent = by_version.get(item["parent_version"] or "")
            if parent is None or not item["reward"]["n"] or not parent["reward"]["n"]:
                continue
            a, b = item["reward"], parent["reward"]

            def sums(version: str, n: int) -> tuple[int, float, float]:
                h = stats[version]
                return n, float(h.get("reward_sum") or 0), float(h.get("reward_sq") or 0)

            delta, ci = welch_delta(sums(item["policy_version"], a["n"]), sums(parent["policy_version"], b["n"]))
            return {"latest": item["policy_version"], "parent": parent["policy_version"], "reward_delta": delta,
                    "ci95": ci}
        return None
