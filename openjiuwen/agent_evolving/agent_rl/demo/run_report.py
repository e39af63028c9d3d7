"""The demo's report: what the rounds, the Training Runs and the bad-version check recorded, written as
`demo-report.json` after every step (in the run directory) and at the end (also in `--out-dir`, with
`demo-reward.png`), and the final printout: the table, the gains, the answers side by side, the time.
(`report.py` holds the statistics, the table and the plot it uses.)"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import calculator_family as calc
from . import report as rep
from . import summary
from .stack import Stack


class RunReport:
    def __init__(self, args: argparse.Namespace, stack: Stack, run_dir: Path, out_dir: Path, t0: float,
                 step: Callable[[], str]) -> None:
        self.args = args
        self.stack = stack
        self.run_dir = run_dir
        self.out_dir = out_dir
        self.t0 = t0
        self.step = step  # the driver's current step: a report written before the end names it
        prepared_since = args.preparation_started
        # What was spent before the demo proper: the caller's preparation (a model conversion the driver did is
        # the stack's).
        self.before_driver_s = None if prepared_since is None else round(time.time() - prepared_since, 2)
        self.timings: dict[str, Any] = {"setup": stack.timings, "rounds": [], "training_runs": []}
        self.versions: list[dict[str, Any]] = []
        self.training_rounds: list[dict[str, Any]] = []
        self.rollout_check: dict[str, Any] | None = None
        self.lineage_run: Any = None  # lineages.TwoLineages under --lineages 2
        self.status = "running"  # set by the driver: completed, interrupted or failed

    def build(self) -> dict[str, Any]:
        total = round(time.monotonic() - self.t0, 2)
        preparation = {"before_driver_s": self.before_driver_s, "model_conversion_s": self.stack.model_conversion_s}
        report: dict[str, Any] = {
            "versions": self.versions,
            "settings": self.settings(),
            "timings": {**self.timings, "total_seconds": total, "preparation": preparation,
                        "demo_seconds": round(total - (preparation["model_conversion_s"] or 0.0), 2)},
            "status": self.status,
            "run_dir": str(self.run_dir),
            "processes": self.stack.pids,
        }
        if self.lineage_run is not None:
            report["lineages"] = self.lineage_run.report()
            cross = self.lineage_run.cross_report()
            if cross is not None:
                report["lineages_cross"] = cross
        if len(self.versions) >= 2:
            report.update(self.margins())
        if self.training_rounds:
            report["training_rounds"] = self.training_rounds
        if self.rollout_check is not None:
            report["rollout_check"] = self.rollout_check
        if self.status != "completed":
            report["failed_step"] = self.step()
        return report

    def settings(self) -> dict[str, Any]:
        a = self.args
        return {
            "rounds": a.rounds, "tasks_per_round": a.tasks, "turns_per_task": a.turns,
            "max_tokens": a.max_tokens, "temperature": 1.0, "concurrency": a.concurrency, "seed": a.seed,
            "model_id": a.model_id, "model": str(self.stack.model_dir), "hidden_size": a.hidden_size,
            "trainer": a.trainer, "vllm": "started" if a.instances is None else "given",
            "instances": a.instances or [], "family": a.family, "dtype": a.dtype,
            "task_family": "answer in plain words (task_family.py)" if a.family == "words" else
            "word problems with a calculator tool (calculator_family.py)",
            "reward": "share of word characters (ASCII letters, space) in the answers' text" if a.family == "words"
            else f"1 for the right final answer, {calc.TOOL_CREDIT} for a calculator call whose value is right, "
                 "else 0; success = the right final answer",
            "eval_tasks": a.eval_tasks if a.family == "calculator" or a.lineages > 1 else None,
            "lineages": a.lineages,
            "ppo": self.stack.ppo_yaml, "advantage_estimator": "reinforce_plus_plus",
        }

    def margins(self) -> dict[str, Any]:
        """The last version against base: the reward's margin, and success's margin and gains where measured."""
        out: dict[str, Any] = {}
        base, last = self.versions[0]["task_rewards"], self.versions[-1]["task_rewards"]
        diff, (lo, hi) = rep.diff_ci95(base, last)
        out["margin"] = {"last_policy": self.versions[-1]["policy"], "last_minus_base": round(diff, 4),
                         "ci95": [round(lo, 4), round(hi, 4)]}
        if "task_success" in self.versions[0]:
            sd, (slo, shi) = rep.diff_ci95(self.versions[0]["task_success"], self.versions[-1]["task_success"])
            out["success_margin"] = {"last_policy": self.versions[-1]["policy"],
                                     "last_minus_base": round(sd, 4), "ci95": [round(slo, 4), round(shi, 4)]}
            out["success_gains"] = summary.success_gains(self.versions)
        return out

    def write(self, final: bool) -> dict[str, Any]:
        report = self.build()
        rep.write_json(self.run_dir / "demo-report.json", report)
        if final:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            rep.write_json(self.out_dir / "demo-report.json", report)
        return report

    def finish(self) -> None:
        """The final report and plot, and what the demo prints at its end."""
        report = self.write(final=True)
        if self.lineage_run is not None:
            print("\n" + self.lineage_run.text())
            print("\n" + summary.time_text(report["timings"]))
            print(f"report {self.out_dir / 'demo-report.json'}")
            return
        plotted = self.plot()
        print()
        print(rep.table(self.versions))
        if "success_gains" in report:
            print("\n" + summary.gains_text(report["success_gains"]))
        margin = report.get("margin")
        if margin:
            what = "shaped reward" if "success_gains" in report else "mean reward"
            print(f"\nlast version {margin['last_policy']} vs base, {what}: {margin['last_minus_base']:+.3f} "
                  f"(95% CI [{margin['ci95'][0]:+.3f}, {margin['ci95'][1]:+.3f}])")
        if "success_gains" in report:
            print("\n" + summary.side_by_side(self.versions[0], self.versions[-1], 4))
        print("\n" + summary.time_text(report["timings"]))
        print(f"report {self.out_dir / 'demo-report.json'}"
              + (f", plot {self.out_dir / 'demo-reward.png'}" if plotted else " (no matplotlib: no plot)"))

    def plot(self) -> bool:
        a = self.args
        if a.family == "calculator":
            title = (f"openjiuwen-rl demo: SmolLM2-135M-Instruct + calculator tool, {a.eval_tasks} "
                     f"held-out Tasks per version, seed {a.seed}")
        else:
            title = f"openjiuwen-rl demo: {a.tasks} Tasks x {a.turns} turns per round, seed {a.seed}"
        plotted = rep.plot(self.run_dir / "demo-reward.png", self.versions, title)
        if plotted:
            shutil.copyfile(self.run_dir / "demo-reward.png", self.out_dir / "demo-reward.png")
        return plotted
