"""`openjiuwen-rl demo --family words --lineages 2` (`make demo-tiny DEMO_ARGS="--lineages 2"`): two lineages with
opposite objectives learn at the same time on one base model, one gateway and one vLLM (issue 27 item 8).

- `plain` is rewarded for plain words (`word_char_share`), `symbols` for the opposite (`other_char_share`). A Task
  succeeds when at least `SUCCESS_SHARE` of its answers' characters are of its lineage's kind: the answer does what
  its lineage asks, whatever the other lineage wants.
- Every round: both lineages' held-out evaluation Tasks (the same prompts and sampling seeds for every version, never
  trained on), then both lineages' training Tasks, all interleaved on one pool of agents; then a Training Run per
  lineage. Each Task starts with `"lineage"` and must be pinned to its own line's active version.
- No operator call in the loop: the RL Service runs with `training_policy.auto: true` and `min_pending_samples` =
  one round of a lineage's training samples (stack_config.py, `lineage_training_policy`), so its scheduler starts each
  lineage's Training Run by itself once that lineage's training Tasks are rewarded (one run at a time here:
  `max_concurrent_runs` 1 on the demo's cores).
  The driver only finds each lineage's new run in the run listing, watches it to its end, checks that its trigger
  is `auto` and that its version is the line's active one on the gateway, then evaluates.

The end: one table per lineage (held-out success per version with its 95 % interval) and each version's gain over
base; `demo-report.json` carries them under `lineages`.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..common.ids import parse_iso_epoch
from ..common.lineage import line_of
from ..common.policy_names import BASE_POLICY
from ..common.wire import routes
from . import report as rep
from . import summary
from .parts import DemoParts
from .progress import Bar
from .task_family import FOLLOW_UP, PROMPTS, other_char_share, word_char_share

SUCCESS_SHARE = 0.5  # a Task succeeds when most of its answers' characters are what its lineage is rewarded for
HELD_OUT_ROUND = 1_000  # the sampling-seed round of every held-out evaluation: the same seeds for every version
TERMINAL_RUN = ("succeeded", "failed", "canceled")


class LineageDemoFailed(Exception):
    """A step of the two-lineage demo went wrong (the driver names the step and its log)."""


@dataclass(frozen=True)
class Objective:
    lineage: str
    wants: str  # what the lineage is rewarded for, in words
    reward: Callable[[Sequence[str]], float]

    def success(self, reward: float) -> bool:
        return reward >= SUCCESS_SHARE


OBJECTIVES = (
    Objective("plain", "plain words (letters and spaces)", word_char_share),
    Objective("symbols", "anything but plain words (digits, punctuation, other bytes)", other_char_share),
)


class TwoLineages:
    """The rounds of `--lineages 2`, run by the Demo's processes and signed clients."""

    OBJECTIVES: tuple[Any, ...] = OBJECTIVES

    def __init__(self, demo: DemoParts) -> None:
        self.demo = demo
        self.args = demo.args
        self.objectives: tuple[Any, ...] = self.OBJECTIVES[:self.args.lineages]
        self.tables: dict[str, list[dict[str, Any]]] = {o.lineage: [] for o in self.objectives}
        self.runs: list[dict[str, Any]] = []
        self.seen_runs: set[str] = set()  # Training Runs already waited for

    def line(self, lineage: str) -> str:
        return line_of(self.args.model_id, lineage)

    # ------------------------------------------------------------------------------------------ rounds

    def run(self) -> None:
        a = self.args
        log = self.demo.run_dir / "gateway" / "gateway.log"
        trained: dict[str, dict[str, Any]] = {}
        for r in range(a.rounds + 1):
            actives = {o.lineage: self.active(o.lineage) for o in self.objectives}
            with self.demo.stage(f"evaluation {r + 1}/{a.rounds + 1} (every lineage)", log):
                t = time.monotonic()
                results = self.batch(r, actives, evaluation=True)
                seconds = round(time.monotonic() - t, 2)
            self.demo.report.timings["rounds"].append({"policy": "every lineage", "kind": "evaluation",
                                                       "seconds": seconds})
            for o in self.objectives:
                entry = self.entry(o, actives[o.lineage], results[o.lineage], seconds, trained.get(o.lineage))
                self.tables[o.lineage].append(entry)
                print(f"  {o.lineage} {entry['policy']} (held-out): success {entry['success_rate']:.3f} "
                      f"[{entry['success_ci95'][0]:.3f}, {entry['success_ci95'][1]:.3f}], reward "
                      f"{entry['mean_reward']:.3f}; e.g. {entry['example']!r}", flush=True)
            self.demo.report.write(final=False)
            if r == a.rounds:
                return
            with self.demo.stage(f"training round {r + 1}/{a.rounds} (every lineage)", log):
                t = time.monotonic()
                self.batch(r, actives, evaluation=False)
            self.demo.report.timings["rounds"].append({"policy": "every lineage", "kind": "training",
                                                       "seconds": round(time.monotonic() - t, 2)})
            # One shared deadline: the demo's service runs one Training Run at a time (`max_concurrent_runs` 1), so
            # a lineage's run may wait for the other's.
            deadline = time.monotonic() + a.train_timeout * len(self.objectives)
            for o in self.objectives:
                with self.demo.stage(f"automatic training run {r + 1}/{a.rounds} of lineage {o.lineage}",
                                     self.demo.run_dir / "gateway" / "rl-service.log"):
                    trained[o.lineage] = self.wait_version(o.lineage, r, deadline)

    def entry(self, o: Objective, lora: str | None, results: list[dict[str, Any]], seconds: float,
              trained: dict[str, Any] | None) -> dict[str, Any]:
        return rep.success_entry(BASE_POLICY if lora is None else lora.rpartition(":")[2], lora, results, seconds,
                                 trained, trigger=trained["trigger"] if trained else None)

    def batch(self, r: int, actives: dict[str, str | None], *, evaluation: bool,
              families: dict[str, str] | None = None, title: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """Every lineage's Tasks of one round, interleaved on one pool of agents (the lineages run at once).
        `families` (lineage -> task family) replaces a lineage's own family: the cross evaluation of the SmolLM2
        demo (family_lineages.py); the words family has one family and ignores it."""
        a = self.args
        count = a.eval_tasks if evaluation else a.tasks
        objectives = [o for o in self.objectives if families is None or o.lineage in families]
        jobs = [(o, i) for i in range(count) for o in objectives]
        kind = "evaluation" if evaluation else "training round"
        bar = Bar(title or f"{kind} {r + 1} ({', '.join(o.lineage for o in objectives)})", total=len(jobs),
                  unit="tasks")
        executor = futures.ThreadPoolExecutor(max_workers=a.concurrency, thread_name_prefix="agent")
        self.demo.rounds.executor = executor  # the Demo's shutdown cancels it on Ctrl-C
        results: dict[str, list[dict[str, Any]]] = {o.lineage: [] for o in objectives}
        try:
            pending = {executor.submit(self.task, o, r, i, actives[o.lineage], evaluation,
                                       None if families is None else families[o.lineage]) for o, i in jobs}
            while pending:
                done, pending = futures.wait(pending, timeout=1.0, return_when=futures.FIRST_COMPLETED)
                for fut in done:
                    x = fut.result()  # a Task's failure fails the round
                    results[x["lineage"]].append(x)
                if done:
                    bar.update(len(done), "  ".join(
                        f"{name} {sum(1 for x in rs if x['success']) / len(rs):.2f}"
                        for name, rs in results.items() if rs))
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            bar.close()
        with open(self.demo.run_dir / "agents.jsonl", "a") as f:
            for name in results:
                results[name].sort(key=lambda x: x["task"])
                for x in results[name]:
                    f.write(json.dumps(x) + "\n")
        return results

    def task(self, o: Any, r: int, i: int, lora: str | None, evaluation: bool,
             family: str | None = None) -> dict[str, Any]:
        from .rounds import sampling_seed

        a, demo = self.args, self.demo
        session, task_id, pinned = self.start_task(o.lineage, r, i, lora, evaluation)
        seed_round = HELD_OUT_ROUND if evaluation else r
        messages: list[dict[str, str]] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        answers: list[str] = []
        for turn in range(a.turns):
            out = demo.stack.agent.chat.completions.create(
                model=a.model_id, messages=messages, max_tokens=a.max_tokens, temperature=1.0,
                seed=sampling_seed(a.seed, seed_round, i, turn), extra_headers={"X-Agent-Session-Id": session})
            text = out.choices[0].message.content or ""
            answers.append(text)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
        reward = o.reward(answers)
        rewarded = self.stop_and_reward(task_id, reward)
        return {"lineage": o.lineage, "round": r, "task": i, "evaluation": evaluation, "rl_task_id": task_id,
                "policy": pinned, "answers": answers, "reward": reward, "success": o.success(reward),
                "samples": rewarded.get("sample_count", 0)}

    def start_task(self, lineage: str, r: int, i: int, lora: str | None, evaluation: bool) -> tuple[str, str, str]:
        """(session, Task id, pinned version) of a signed Task start of `lineage`, checked to be pinned to its own
        line's active version `lora` (never another lineage's)."""
        session = f"demo-{lineage}-{'e' if evaluation else 't'}{r}-{i}-{secrets.token_hex(3)}"
        body: dict[str, Any] = {"reward_mode": "terminal", "lineage": lineage}
        if evaluation:
            body["evaluation"] = True  # held out: counted per version, never claimed by a Training Run
        started = self.demo.stack.signed(*routes.TASK_START.at(), json_body=body,
                                         headers={"X-Agent-Session-Id": session}, agent=True)
        if started.status_code != 201:
            raise LineageDemoFailed(f"Task start ({lineage}) answered {started.status_code}: {started.text[:300]}")
        task = started.json()
        task_id, pinned = task["rl_task_id"], task.get("policy_lora_name") or BASE_POLICY
        if pinned != (lora or BASE_POLICY):
            raise LineageDemoFailed(f"Task {task_id} of lineage {lineage} is pinned to {pinned}, expected "
                                    f"{lora or BASE_POLICY}")
        return session, task_id, pinned

    def stop_and_reward(self, task_id: str, reward: float) -> dict[str, Any]:
        """Signed stop (the Task must finalize), then the signed terminal reward; the reward answer."""
        stopped = self.demo.stack.signed(*routes.TASK_STOP.at(task_id), agent=True)
        if stopped.status_code != 200 or stopped.json().get("status") != "finalized":
            raise LineageDemoFailed(f"Task {task_id} stop answered {stopped.status_code}: {stopped.text[:300]}")
        return self.demo.calls.publish_reward(task_id, reward)

    # ------------------------------------------------------------------------------------------ Training Runs

    def active(self, lineage: str) -> str | None:
        line = self.line(lineage)
        r = self.demo.stack.signed("GET", f"/v1/loras/{line}")
        if r.status_code != 200:
            raise LineageDemoFailed(f"GET /v1/loras/{line} answered {r.status_code}: {r.text[:300]}")
        active = r.json().get("active_lora")
        return active["lora_name"] if active else None

    def new_run(self, lineage: str) -> dict[str, Any] | None:
        """The lineage's Training Run that this driver has not seen yet, from the lineage's newest runs
        (`?lineage=`), or None while the scheduler started none. A run that started and ended between two polls is
        still found."""
        got = self.demo.stack.signed(*routes.RUN_LIST.at(), params={"limit": 50, "lineage": lineage})
        if got.status_code != 200:
            raise LineageDemoFailed(f"GET /v1/rl/training/runs answered {got.status_code}: {got.text[:300]}")
        fresh = [run for run in got.json()["items"] if run["training_run_id"] not in self.seen_runs]
        return fresh[-1] if fresh else None  # newest first: the oldest unseen one

    def wait_version(self, lineage: str, r: int, deadline: float) -> dict[str, Any]:
        """The lineage's next version, trained by a run the RL Service's scheduler started (never this driver):
        wait for the run, watch it to its end, check that its trigger is `auto` and that its version is then the
        line's active one."""
        a, demo = self.args, self.demo
        bar = Bar(f"automatic training run {r + 1}/{a.rounds} of {lineage}", total=4, unit="stages")
        reached = 0
        try:
            run = None
            while True:
                run = self.new_run(lineage) if run is None else self.get_run(run["training_run_id"])
                status = run["status"] if run else "waiting for the scheduler"
                stage = run.get("stage") if run else None
                level = 0 if run is None else 4 if status == "succeeded" else \
                    {"training": 2, "activating": 3}.get(stage or "", 1)
                if level > reached:
                    bar.update(level - reached, status if status in TERMINAL_RUN else stage or status)
                    reached = level
                if run is not None and status in TERMINAL_RUN:
                    break
                if time.monotonic() > deadline:
                    raise LineageDemoFailed(
                        f"no new version of {self.line(lineage)} within {a.train_timeout * len(self.objectives):.0f}"
                        f" s after the training round ({'no run started' if run is None else f'run {status}'}; "
                        f"the scheduler's view of {lineage}: {self.scheduler_view(lineage)})")
                demo.stack.check("gateway")
                time.sleep(0.2)
        finally:
            bar.close()
        run_id = run["training_run_id"]
        self.seen_runs.add(run_id)
        if status != "succeeded":
            raise LineageDemoFailed(f"Training Run {run_id} of {lineage} ended {status}: {run.get('failure_reason')}")
        trigger = run.get("trigger") or {}
        if trigger.get("kind") != "auto" or trigger.get("lineage") != lineage:
            raise LineageDemoFailed(f"Training Run {run_id} of {lineage} was not started by automatic training of "
                                    f"its lineage: trigger {trigger}")
        if self.active(lineage) != run["lora_name"]:
            raise LineageDemoFailed(f"Training Run {run_id} succeeded with {run['lora_name']} but it is not the "
                                    f"active version of {self.line(lineage)}")
        # The run's own time (claim to activation), not the driver's wait, which may include the other lineage's.
        seconds = round(parse_iso_epoch(run["finished_at"]) - parse_iso_epoch(run["created_at"]), 2)
        record = {"lineage": lineage, "training_run_id": run_id, "lora_name": run["lora_name"],
                  "sample_count": run["sample_count"], "seconds": seconds, "trigger": trigger}
        self.runs.append(record)
        demo.report.timings["training_runs"].append(record)
        print(f"  {run['lora_name']} trained on {run['sample_count']} samples of {lineage} and activated in "
              f"{seconds:.1f} s; started by automatic training ({trigger.get('reason')})", flush=True)
        return record

    def scheduler_view(self, lineage: str) -> str:
        """Why the scheduler has not trained the lineage (`GET /v1/rl/lineages/{lineage}`), for a failure message."""
        got = self.demo.stack.signed(*routes.LINEAGE.at(lineage))
        if got.status_code != 200:
            return f"GET /v1/rl/lineages/{lineage} answered {got.status_code}"
        view = got.json().get("scheduler") or {}
        return (f"reason {view.get('reason')}, {view.get('pending_samples')} pending samples "
                f"({view.get('eligible_samples')} eligible), active run {view.get('active_run')}")

    def get_run(self, run_id: str) -> dict[str, Any]:
        got = self.demo.stack.signed(*routes.RUN.at(run_id))
        if got.status_code != 200:
            raise LineageDemoFailed(f"GET run {run_id} answered {got.status_code}: {got.text[:300]}")
        return got.json()

    # ------------------------------------------------------------------------------------------ report

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for o in self.objectives:
            versions = self.tables[o.lineage]
            out[o.lineage] = {"line": self.line(o.lineage), "rewarded_for": o.wants,
                              "success": getattr(o, "success_rule", f"reward >= {SUCCESS_SHARE}"),
                              "versions": versions,
                              "success_gains": summary.success_gains(versions) if len(versions) > 1 else []}
        return out

    def cross_report(self) -> dict[str, Any] | None:
        """The cross table of lineages on each other's task family: none here (one family for both lineages)."""
        return None

    def text(self) -> str:
        parts = []
        for name, section in self.report().items():
            parts.append(f"lineage {name} ({section['line']}), rewarded for {section['rewarded_for']}; held-out "
                         f"success = {section['success']}:")
            parts.append(rep.table(section["versions"]))
            for v in section["versions"]:
                if v.get("trigger"):  # who started each version's Training Run: the scheduler, never the driver
                    parts.append(f"  {v['policy']}: Training Run {v['training_run_id']}, trigger "
                                 f"{v['trigger']['kind']} ({v['trigger'].get('reason')})")
            if section["success_gains"]:
                parts.append(summary.gains_text(section["success_gains"]))
            parts.append("")
        return "\n".join(parts).rstrip()
