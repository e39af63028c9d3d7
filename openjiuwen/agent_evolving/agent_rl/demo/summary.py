"""The demo's closing lines, after the table: each version's held-out success gain over base, a few held-out answers of
base and of the last version side by side, and where the time went (the first run's preparation apart).

Pure functions of the report's parts, so the same numbers are printed and written to `demo-report.json`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import report as rep


def success_gains(versions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every later version's held-out success minus base's, with Welch's 95 % interval over the Tasks' successes."""
    base = versions[0]
    gains = []
    for version in versions[1:]:
        gain, (lo, hi) = rep.diff_ci95(base["task_success"], version["task_success"])
        gains.append({"policy": version["policy"], "success_minus_base": round(gain, 4),
                      "ci95": [round(lo, 4), round(hi, 4)]})
    return gains


def gains_text(gains: Sequence[dict[str, Any]]) -> str:
    lines = ["held-out success gain over base (95% CI):"]
    width = max(len(g["policy"]) for g in gains)
    for g in gains:
        lo, hi = g["ci95"]
        lines.append(f"  {g['policy']:<{width}}  {g['success_minus_base']:+.3f}  [{lo:+.3f}, {hi:+.3f}]")
    return "\n".join(lines)


def outcome_changes(base: dict[str, Any], last: dict[str, Any]) -> dict[str, list[int]]:
    """Indexes of the held-out problems by how their outcome went from base to the last version."""
    changes: dict[str, list[int]] = {"wrong → right": [], "right → wrong": [], "right in both": [],
                                     "wrong in both": []}
    for i, (b, l) in enumerate(zip(base["answers"], last["answers"])):
        key = {(False, True): "wrong → right", (True, False): "right → wrong", (True, True): "right in both",
               (False, False): "wrong in both"}[(b["success"], l["success"])]
        changes[key].append(i)
    return changes


def examples(changes: dict[str, list[int]], count: int) -> list[int]:
    """Which problems to show: those whose outcome changed first (one that got worse, if any, beside those that got
    better), then unchanged ones; in held-out order. The counts printed with them say how typical they are."""
    worse = changes["right → wrong"][:1]
    chosen = changes["wrong → right"][:count - len(worse)] + worse
    unchanged = sorted(changes["right in both"] + changes["wrong in both"])
    chosen += unchanged[:count - len(chosen)]
    return sorted(chosen)


def side_by_side(base: dict[str, Any], last: dict[str, Any], count: int) -> str:
    """The same held-out problems answered by base and by the last version, for reading what changed."""
    changes = outcome_changes(base, last)
    shown = examples(changes, count)
    counts = ", ".join(f"{key} {len(idx)}" for key, idx in changes.items())
    lines = [f"held-out problems, {base['policy']} vs {last['policy']}: {counts}",
             f"{len(shown)} of them side by side (changed outcomes first):"]
    for i in shown:
        b, l = base["answers"][i], last["answers"][i]
        lines.append(f"  Q: {b['question']} (answer {b['answer']})")
        for who, x in ((base["policy"], b), (last["policy"], l)):
            mark = "right" if x["success"] else "wrong"
            lines.append(f"    {who:>4} [{mark}, reward {x['reward']:.1f}]: " + "  ->  ".join(
                [repr(x["completions"][0]), x["tool_result"], repr(x["completions"][-1])]))
    return "\n".join(lines)


def minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60:02d} s" if whole >= 60 else f"{whole} s"


def time_text(timings: dict[str, Any]) -> str:
    """The demo's own time by stage, then the first run's preparation (environments, model) on a line of its own."""
    prep = timings["preparation"]
    parts = [f"set-up {timings['setup'].get('total_s', 0.0) - (prep['model_conversion_s'] or 0.0):.0f} s"]
    for kind, name in (("evaluation", "held-out evaluations"), ("training", "training rounds"), (None, "rounds")):
        spent = [r["seconds"] for r in timings["rounds"] if r.get("kind") == kind]
        if spent:
            parts.append(f"{len(spent)} {name} {sum(spent):.0f} s")
    runs = timings["training_runs"]
    if runs:
        parts.append(f"{len(runs)} Training Runs {sum(r['seconds'] for r in runs):.0f} s")
    lines = [f"time: the demo {minutes(timings['demo_seconds'])} ({', '.join(parts)})"]
    said = []
    if prep["before_driver_s"] is not None:
        said.append(f"{minutes(prep['before_driver_s'])} before the driver started (environments, redis-server, "
                    "the model: built on a first run, reused later)")
    if prep["model_conversion_s"] is not None:
        said.append(f"{minutes(prep['model_conversion_s'])} converting SmolLM2 into its cache (first run only)")
    if said:
        lines.append("preparation, not counted in the demo's time: " + "; ".join(said))
    return "\n".join(lines)
