"""Per-policy-version aggregates, maintained incrementally in Redis (`rl:v1:policy_stats:{version}`, a HASH).

A sample adds its contribution in the same MULTI that publishes it (`SamplePublisher.insert_if_absent`) and a
rolled-back publication takes it away again, so `GET /v1/rl/policies` reads O(versions) hashes and never scans
samples. The reward statistics count independent rewards: a Judge-scored sample is one, while a terminal reward is
one per Task (all its completions share it), added by the reward's completing MULTI (`add_task_reward`).

Fields: `tasks` (added at Task start), `samples`, `reward_n`, `reward_sum`, `reward_sq`, `source:<s>`, `tokens`,
the same for evaluation Tasks alone (`eval_tasks`, `eval_samples`, `eval_reward_n`, `eval_reward_sum`,
`eval_reward_sq`: their samples count in both, so the evaluation is read apart from the training traffic),
`judge_multi` / `judge_spread` (samples with ≥ 2 successful votes, and the sum of their vote spread on [0, 1]),
`lat_n`, `lat_sum_ms`, `lat_le:<bound>` (completion latency histogram, per bucket, not cumulative), and the lineage
`parent` / `training_run_id` written when a run publishes the version. Samples removed by retention stay counted:
the aggregates describe what each version produced.
"""

from __future__ import annotations

import math
from typing import Any

from ...common import ids
from . import keys

# Completion latency bucket upper bounds in milliseconds; the last bucket is `+Inf`.
LATENCY_BOUNDS_MS = (50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)
INF = "+Inf"
TERMINAL = "terminal"


def latency_bucket(ms: float) -> str:
    for bound in LATENCY_BOUNDS_MS:
        if ms <= bound:
            return str(bound)
    return INF


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def contribution(meta: dict[str, Any], response_tokens: int) -> tuple[dict[str, int], dict[str, float]]:
    """(integer increments, float increments) one published sample adds to its version's hash."""
    ints: dict[str, int] = {"samples": 1, "tokens": response_tokens}
    floats: dict[str, float] = {}
    evaluation = meta.get("evaluation") is True
    if evaluation:
        ints["eval_samples"] = 1
    judge = meta.get("judge") if isinstance(meta.get("judge"), dict) else None
    score = _finite(judge.get("score")) if judge else None
    if judge is not None and score is not None:
        source = judge.get("source") or "unknown"
        ints[keys.stats_source(source)] = 1
        if source != TERMINAL:  # a terminal reward counts once per Task, see `add_task_reward`
            for prefix in ("", "eval_") if evaluation else ("",):
                ints[f"{prefix}reward_n"] = 1
                floats[f"{prefix}reward_sum"] = score
                floats[f"{prefix}reward_sq"] = score * score
        votes = [v for v in (_finite(x) for x in judge.get("votes") or []) if v is not None]
        if len(votes) >= 2:
            ints["judge_multi"] = 1
            floats["judge_spread"] = min(1.0, max(0.0, (max(votes) - min(votes)) / 10.0))
    latency = _finite(meta.get("completion_latency_ms"))
    if latency is not None and latency >= 0:
        ints["lat_n"] = 1
        ints[f"lat_le:{latency_bucket(latency)}"] = 1
        floats["lat_sum_ms"] = latency
    return ints, floats


def add_task_reward(pipe: Any, key: str, reward: float, *, evaluation: bool = False) -> None:
    """Queue one terminal Task reward (one independent observation, however many samples share it); an
    evaluation Task's reward counts in the evaluation fields too."""
    for prefix in ("", "eval_") if evaluation else ("",):
        pipe.hincrby(key, f"{prefix}reward_n", 1)
        pipe.hincrbyfloat(key, f"{prefix}reward_sum", reward)
        pipe.hincrbyfloat(key, f"{prefix}reward_sq", reward * reward)


def queue_contribution(pipe: Any, key: str, meta: dict[str, Any], response_tokens: int, sign: int) -> None:
    """Queue the HINCRBY / HINCRBYFLOAT of one sample (sign +1 publish, -1 roll back) inside the caller's MULTI."""
    ints, floats = contribution(meta, response_tokens)
    for name, n in ints.items():
        pipe.hincrby(key, name, sign * n)
    for name, x in floats.items():
        pipe.hincrbyfloat(key, name, sign * x)


def queue_sample_contribution(pipe: Any, policy_version: str, meta: dict[str, Any], response_ids: bytes,
                              sign: int) -> None:
    """Queue a sample's contribution (+1) to its version's aggregates, or its removal (-1) by a rolled-back
    publication, in the caller's MULTI; the version joins `POLICY_VERSIONS` with its first sample."""
    if not ids.is_token_id(policy_version):
        return  # not a name a key may carry; such a version is simply not reported
    queue_contribution(pipe, keys.policy_stats(policy_version), meta, len(response_ids) // 4, sign)
    if sign > 0:
        pipe.sadd(keys.POLICY_VERSIONS, policy_version)
