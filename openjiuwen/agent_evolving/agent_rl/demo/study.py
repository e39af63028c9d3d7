"""Summarise several calculator-demo runs (one per seed): a Markdown table and a curves plot for docs/learning.md.

    python -m openjiuwen.agent_evolving.agent_rl.demo.study RUN_DIR/demo-report.json ... --plot docs/learning-curves.png

Per seed: held-out success and shaped reward of every version, the last version's success gain over base with
Welch's 95 % interval, whether the shaped reward ever rose while success fell, and the time per stage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import report as rep


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    versions = report["versions"]
    base, last = versions[0], versions[-1]
    gain, (lo, hi) = rep.diff_ci95(base["task_success"], last["task_success"])
    # "Shaped reward up while success down", between consecutive versions and last vs base.
    pairs = list(zip(versions, versions[1:])) + [(base, last)]
    divergent = [f"{a['policy']}->{b['policy']}" for a, b in pairs
                 if b["mean_reward"] > a["mean_reward"] and b["success_rate"] < a["success_rate"]]
    t = report["timings"]
    runs = t.get("training_runs", [])
    return {
        "seed": report["settings"]["seed"],
        "success": [v["success_rate"] for v in versions],
        "reward": [v["mean_reward"] for v in versions],
        "policies": [v["policy"] for v in versions],
        "gain": gain, "ci95": (lo, hi), "divergent": divergent,
        "setup_s": t["setup"].get("total_s"),
        "eval_s": sum(r["seconds"] for r in t["rounds"] if r.get("kind") == "evaluation"),
        "generation_s": sum(r["seconds"] for r in t["rounds"] if r.get("kind") == "training"),
        "training_s": sum(r["seconds"] - (r.get("activation_s") or 0) for r in runs),
        "activation_s": sum(r.get("activation_s") or 0 for r in runs),
        "first_served_s": [r.get("first_served_s") for r in runs],
        "total_s": t.get("total_seconds"),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    width = max(len(r["policies"]) for r in rows)
    names = rows[0]["policies"] + [""] * (width - len(rows[0]["policies"]))
    head = ["seed"] + [f"{p} success / reward" for p in names] + ["last − base success (95 % CI)",
                                                                   "reward up, success down"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["seed"])] + [f"{s:.3f} / {w:.3f}" for s, w in zip(r["success"], r["reward"])]
        cells += [f"**{r['gain']:+.3f}** [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]",
                  ", ".join(r["divergent"]) or "never"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| seed | set-up s | generation s (training Tasks) | training s | activation s | "
                  "first completion on the new adapter s | evaluation s | total s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        served = ", ".join(f"{x:.1f}" for x in r["first_served_s"] if x is not None) or "-"
        lines.append(f"| {r['seed']} | {r['setup_s']:.0f} | {r['generation_s']:.0f} | {r['training_s']:.0f} | "
                     f"{r['activation_s']:.1f} | {served} | {r['eval_s']:.0f} | {r['total_s']:.0f} |")
    return "\n".join(lines)


def pooled(reports: list[dict[str, Any]]) -> str:
    """The seeds together: last version's held-out success minus base's over all seeds' Tasks (Welch), and the mean
    of the per-seed gains with a t-interval over the seeds."""
    base = [x for r in reports for x in r["versions"][0]["task_success"]]
    last = [x for r in reports for x in r["versions"][-1]["task_success"]]
    gain, (lo, hi) = rep.diff_ci95(base, last)
    gains = [summarise(r)["gain"] for r in reports]
    mean, (glo, ghi) = rep.mean_ci95(gains)
    return (f"Pooled over {len(reports)} seeds ({len(base)} base and {len(last)} last-version Tasks): success "
            f"{sum(base) / len(base):.3f} → {sum(last) / len(last):.3f}, gain **{gain:+.3f}** (Welch 95 % CI "
            f"[{lo:+.3f}, {hi:+.3f}]); mean of the per-seed gains {mean:+.3f} (t-interval over seeds "
            f"[{glo:+.3f}, {ghi:+.3f}]).")


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=110, sharey=True)
    for r in rows:
        xs = list(range(len(r["policies"])))
        axes[0].plot(xs, r["success"], marker="o", label=f"seed {r['seed']}")
        axes[1].plot(xs, r["reward"], marker="s", label=f"seed {r['seed']}")
    for ax, title in zip(axes, ("held-out success rate", "held-out shaped reward")):
        ax.set_xticks(range(len(rows[0]["policies"])), rows[0]["policies"])
        ax.set_title(title, fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, calculator-tool word problems, 64 held-out Tasks per version", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m openjiuwen.agent_evolving.agent_rl.demo.study")
    p.add_argument("reports", nargs="+", type=Path, help="demo-report.json of calculator runs")
    p.add_argument("--plot", type=Path, default=None, help="write the curves here (PNG)")
    args = p.parse_args(argv)
    reports = [json.loads(path.read_text()) for path in args.reports]
    rows = [summarise(r) for r in reports]
    print(markdown(rows))
    print("\n" + pooled(reports))
    if args.plot is not None and not plot(rows, args.plot):
        print("no matplotlib: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
