"""Statistics, the final table, `demo-report.json` and the plot `demo-reward.png`.

The unit of evaluation is the Task (all completions of a Task share its terminal reward), so a version's mean reward
and its 95 % confidence interval (Student's t) are over its Tasks' rewards.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t975(df: float) -> float:
    """The 97.5 % quantile of Student's t with `df` degrees of freedom (table, then the Cornish-Fisher series)."""
    if df < 1:
        return math.inf
    if df <= len(_T975) and float(df).is_integer():
        return _T975[int(df) - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci95(values: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """Mean and its 95 % t-interval; a single value gives a zero-width interval."""
    n = len(values)
    if n == 0:
        return math.nan, (math.nan, math.nan)
    mean = sum(values) / n
    if n == 1:
        return mean, (mean, mean)
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = t975(n - 1) * math.sqrt(var / n)
    return mean, (mean - half, mean + half)


def diff_ci95(a: Sequence[float], b: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """mean(b) − mean(a) with Welch's 95 % interval."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    if na < 2 or nb < 2:
        return mb - ma, (mb - ma, mb - ma)
    va = sum((v - ma) ** 2 for v in a) / (na - 1) / na
    vb = sum((v - mb) ** 2 for v in b) / (nb - 1) / nb
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / ((va**2 / (na - 1) if va else 0) + (vb**2 / (nb - 1) if vb else 0)) if se else na + nb - 2
    half = t975(df) * se
    return mb - ma, (mb - ma - half, mb - ma + half)


def version_entry(policy: str, rewards: Sequence[float], samples: int, **extra: Any) -> dict[str, Any]:
    mean, (lo, hi) = mean_ci95(rewards)
    return {"policy": policy, "mean_reward": round(mean, 4), "ci95": [round(lo, 4), round(hi, 4)],
            "tasks": len(rewards), "samples": samples, **extra}


def success_entry(policy: str, lora_name: str | None, results: Sequence[dict[str, Any]], seconds: float,
                  trained: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    """A version's held-out evaluation: the mean reward and the success rate of its Tasks (`results`, each with
    `reward`, `success`, `samples`, `answers`), each with its 95 % interval, and the Training Run that made it."""
    rewards = [x["reward"] for x in results]
    success = [1.0 if x["success"] else 0.0 for x in results]
    rate, (lo, hi) = mean_ci95(success)
    return version_entry(
        policy, rewards, sum(x["samples"] for x in results), lora_name=lora_name, round_seconds=seconds,
        training_seconds=trained["seconds"] if trained else None,
        training_run_id=trained["training_run_id"] if trained else None,
        success_rate=round(rate, 4), success_ci95=[round(lo, 4), round(hi, 4)],
        task_rewards=[round(x, 4) for x in rewards], task_success=success, **extra,
        example=" | ".join(results[0]["answers"]))


def reason_counts(results: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many Tasks ended for each reason (`results[].reason`), by reason name."""
    return dict(sorted(Counter(x["reason"] for x in results).items()))


def table(versions: Sequence[dict[str, Any]]) -> str:
    """The final table: one line per policy version."""
    success = bool(versions) and "success_rate" in versions[0]
    head: tuple[str, ...] = ("policy", "mean reward", "95% CI", "tasks", "samples", "round s", "trained in s")
    if success:
        head = ("policy", "success", "95% CI", "shaped reward", "95% CI", "tasks", "samples", "eval s",
                "trained in s")
    rows = [head]
    for v in versions:
        trained = v.get("training_seconds")
        reward = (f"{v['mean_reward']:.3f}", f"[{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]")
        rate = (f"{v['success_rate']:.3f}", f"[{v['success_ci95'][0]:.3f}, {v['success_ci95'][1]:.3f}]") \
            if success else ()
        rows.append((
            v["policy"], *rate, *reward, str(v["tasks"]), str(v["samples"]), f"{v.get('round_seconds', 0.0):.1f}",
            "-" if trained is None else f"{trained:.1f}",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


def plot(path: Path, versions: Sequence[dict[str, Any]], title: str) -> bool:
    """Mean reward per version with its 95 % CI over the per-Task rewards (jittered dots). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    jitter = random.Random(0)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    xs = list(range(len(versions)))
    for x, v in zip(xs, versions):
        rewards = v.get("task_rewards", [])
        ax.scatter([x + jitter.uniform(-0.18, 0.18) for _ in rewards], rewards, s=12, alpha=0.35, color="tab:blue",
                   linewidths=0, label="Task reward" if x == 0 else None)
    means = [v["mean_reward"] for v in versions]
    lows = [v["mean_reward"] - v["ci95"][0] for v in versions]
    highs = [v["ci95"][1] - v["mean_reward"] for v in versions]
    success = bool(versions) and "success_rate" in versions[0]
    ax.errorbar(xs, means, yerr=[lows, highs], color="tab:red", marker="o", capsize=5, linewidth=2,
                label="mean shaped reward, 95% CI" if success else "mean reward, 95% CI")
    if success:
        rates = [v["success_rate"] for v in versions]
        ax.errorbar([x + 0.06 for x in xs], rates,
                    yerr=[[v["success_rate"] - v["success_ci95"][0] for v in versions],
                          [v["success_ci95"][1] - v["success_rate"] for v in versions]],
                    color="tab:green", marker="s", capsize=5, linewidth=2, label="held-out success rate, 95% CI")
    ax.set_xticks(xs, [v["policy"] for v in versions])
    ax.set_xlabel("policy version")
    ax.set_ylabel("held-out success / shaped reward" if success else "reward (share of word characters)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return True
