"""`--bad-version`: one deliberately bad version and the canary rollout that should roll it back.

After the rounds, a training round whose published rewards are inverted (1 - r) trains a bad version; the RL Service
runs with `rollout.mode canary` (`stack_config.canary_settings`; the rounds promote their own versions as an
operator would), so the bad version becomes the canary's candidate. Tasks with their true rewards, half of them
pinned to the candidate, run until the decision loop decides; the report's `rollout_check` shows both arms and the
decision, and the demo fails when the bad version was not rolled back (docs/rollout.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..common.policy_names import BASE_POLICY
from . import calculator_family as calc
from . import report as rep
from .calls import ServiceCalls
from .failures import DemoFailed
from .rounds import Rounds, policy_label
from .run_report import RunReport
from .stack import Stage
from .stack_config import canary_settings

CANARY_BATCHES = 8  # batches of canary Tasks (each about min_tasks per arm) before the demo gives up waiting


class RolloutCheck:
    def __init__(self, args: argparse.Namespace, calls: ServiceCalls, rounds: Rounds, report: RunReport,
                 stage: Stage, run_dir: Path) -> None:
        self.args = args
        self.calls = calls
        self.rounds = rounds
        self.report = report
        self.stage = stage
        self.run_dir = run_dir

    def bad_version_check(self) -> None:
        """One deliberately bad version and the canary that should roll it back: a training round whose published
        rewards are 1 - r, its Training Run (the candidate), then Tasks with their true rewards, half of them pinned
        to the candidate, until the decision loop decides. Not rolled back → the demo fails, saying so."""
        a = self.args
        active = self.calls.active_policy()
        label = policy_label(active)
        r = a.rounds + 1  # past the rounds' own indexes: fresh sampling seeds
        log = self.run_dir / "gateway" / "gateway.log"
        with self.stage("bad training round (inverted rewards)", log):
            pending = self.calls.pending_samples()
            if pending:  # the bad run would claim them before the inverted ones
                raise DemoFailed(f"{pending} samples with true rewards are still pending before the inverted round")
            t = time.monotonic()
            problems = (calc.problems("train", a.tasks * (max(1, a.rounds) + 1), a.seed)[-a.tasks:]
                        if a.family == "calculator" else None)
            results = self.rounds.run_round(r, active, label, problems, invert=True,
                                            title=f"bad training round ({label}, rewards inverted)")
            true_mean = sum(x["reward"] for x in results) / len(results)
            print(f"  bad training round on {label}: true reward {true_mean:.3f}, published 1 - r = "
                  f"{1 - true_mean:.3f} over {len(results)} Tasks in {time.monotonic() - t:.1f} s", flush=True)
        with self.stage("bad training run", self.run_dir / "gateway" / "rl-service.log"):
            run = self.rounds.train(r, active, candidate_only=True, title="training run (inverted rewards)")
        with self.stage(f"canary of {run['lora_name']}", log):
            record, tasks = self.canary_window(active, run["lora_name"])
        check = self.report.rollout_check = self.rollout_section(active, run, record, tasks)
        self.report.write(final=False)
        self.print_rollout_check()
        if check["outcome"] != "rolled_back":
            raise DemoFailed(f"the deliberately bad version {run['lora_name']} was not rolled back: "
                             f"{check['outcome']} ({check.get('reason')})")

    def canary_window(self, active: str | None, candidate: str) -> tuple[dict[str, Any] | None, list[dict]]:
        """Batches of Tasks with true rewards (calculator: the held-out problems, as evaluation Tasks) until the
        current canary ends; returns its record (None if undecided after CANARY_BATCHES batches) and the Tasks."""
        a = self.args
        held_out = calc.problems("held-out", a.eval_tasks, 0) if a.family == "calculator" else None
        tasks: list[dict[str, Any]] = []
        for batch in range(CANARY_BATCHES):
            title = f"canary batch {batch + 1} ({policy_label(active)} vs {policy_label(candidate)})"
            # Evaluation Tasks: they count in their arm but are never trained on.
            tasks += self.rounds.run_round(a.rounds + 2 + batch, active, policy_label(active), held_out,
                                           evaluation=True, count=2 * a.canary_min_tasks, candidate=candidate,
                                           title=title)
            deadline = time.monotonic() + 5.0  # the loop evaluates every second
            while time.monotonic() < deadline:
                status = self.calls.rollout_status()
                if status["current"] is None:
                    ended = [x for x in status["recent"] if x.get("candidate", {}).get("lora_name") == candidate]
                    return (ended[0] if ended else None), tasks
                time.sleep(0.5)
            evaluation = (status["current"] or {}).get("evaluation") or {}
            print(f"  canary after {len(tasks)} Tasks: {evaluation.get('reason', '?')} — "
                  f"{evaluation.get('detail', '')}", flush=True)
        return None, tasks

    def rollout_section(self, active: str | None, run: dict[str, Any], record: dict[str, Any] | None,
                        tasks: list[dict[str, Any]]) -> dict[str, Any]:
        candidate = run["lora_name"]
        arms = {}
        for arm, name in (("candidate", candidate), ("active", active or BASE_POLICY)):
            rewards = [x["reward"] for x in tasks if (x["policy"] or BASE_POLICY) == name]
            mean, (lo, hi) = rep.mean_ci95(rewards) if rewards else (None, (None, None))
            arms[arm] = {"lora_name": name, "tasks": len(rewards), "mean_reward": mean, "ci95": [lo, hi]}
        decision = (record or {}).get("decision") or {}
        return {
            "candidate": candidate, "active": active or BASE_POLICY, "training_run_id": run["training_run_id"],
            "rollout_id": (record or {}).get("rollout_id"),
            "outcome": (record or {}).get("status", "undecided"), "reason": decision.get("reason"),
            "detail": decision.get("detail"), "by": decision.get("by"),
            "reward_delta": decision.get("reward_delta"), "ci95": decision.get("ci95"),
            "service_arms": decision.get("arms"), "demo_arms": arms, "canary_tasks": len(tasks),
            "settings": canary_settings(self.args.canary_min_tasks),
        }

    def print_rollout_check(self) -> None:
        c = self.report.rollout_check
        if c is None:
            return
        print(f"\nbad version {c['candidate']} (trained on inverted rewards) vs active {c['active']}, "
              f"{c['canary_tasks']} canary Tasks:")
        for arm, a in c["demo_arms"].items():
            if a["tasks"]:
                print(f"  {arm:9s} {a['lora_name']:>12s}: {a['tasks']} Tasks, mean reward {a['mean_reward']:.3f} "
                      f"[{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}]")
        if c["ci95"]:
            print(f"  candidate - active: {c['reward_delta']:+.3f}, 95% CI [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]")
        print(f"  decision: {c['outcome']} ({c['reason']}, by {c['by']}): {c['detail']}", flush=True)
