"""The demo's rounds on the default lineage: agents run Tasks, Training Runs turn them into versions.

Rounds: agents (the official `openai` SDK through the gateway, `X-Agent-Session-Id` per Task) run the Tasks of the
"answer in plain words" family (`task_family.py`): signed start with a terminal reward → `--turns` completions →
signed stop → the reward computed from the answers' text → signed reward. Then a Training Run
(`POST /v1/rl/training/runs`) is watched until it ends; its new LoRA is activated by the gateway on vLLM, and the next
round's Tasks are pinned to it. Each round is also the evaluation of the policy that served it (the same Tasks, the
same sampling seeds every round), so the table shows base, v1, v2, … with the mean reward and its 95 % CI.

`--family calculator`: each version, base first, is evaluated on the same held-out problems as evaluation Tasks
(never trained on); training Tasks use fresh train problems (`calculator_family.py`: a calculator call, the tool's
result, the final answer); each version's entry carries success and the shaped reward separately, the activation
latency of each new adapter and every answer (docs/learning.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..common.policy_names import BASE_POLICY
from ..common.wire import routes
from . import calculator_family as calc
from . import report as rep
from .calls import ServiceCalls
from .failures import DemoFailed
from .progress import Bar
from .run_report import RunReport
from .stack import Stack, Stage
from .task_family import FOLLOW_UP, PROMPTS, word_char_share

TERMINAL_RUN = ("succeeded", "failed", "canceled")


def sampling_seed(seed: int, round_: int, task: int, turn: int) -> int:
    """vLLM's per-request seed: reproducible for a demo seed, and fresh in every round, so a round never replays
    the samples its policy was trained on (the round's rewards are then an honest evaluation of that policy)."""
    return (seed * 1_000_003 + round_ * 10_007 + task * 101 + turn) % (2**31)


def policy_label(lora_name: str | None) -> str:
    return BASE_POLICY if not lora_name or lora_name == BASE_POLICY else lora_name.rpartition(":")[2]


class Rounds:
    def __init__(self, args: argparse.Namespace, stack: Stack, calls: ServiceCalls, report: RunReport,
                 stage: Stage, run_dir: Path) -> None:
        self.args = args
        self.stack = stack
        self.calls = calls
        self.report = report
        self.stage = stage
        self.run_dir = run_dir
        self.executor: futures.ThreadPoolExecutor | None = None  # the agents of the batch running now

    def run(self) -> None:
        """The rounds of the default lineage: the words family's, or the calculator family's."""
        if self.args.family == "calculator":
            self.calculator_rounds()
        else:
            self.words_rounds()

    def words_rounds(self) -> None:
        """Per round: Tasks on the active version (its evaluation: the same prompts and seeds every round), then
        a Training Run on their samples, whose version the next round's Tasks are pinned to."""
        a = self.args
        pending_training: dict[str, Any] | None = None
        for r in range(a.rounds + 1):
            lora = self.calls.active_policy()
            label = policy_label(lora)
            # Under --bad-version the last round's Tasks are evaluation Tasks: never trained on, so the bad
            # Training Run that follows claims the inverted round's samples only.
            results, seconds = self.timed(f"round {r + 1}/{a.rounds + 1} (policy {label})", lambda: self.run_round(
                r, lora, label, evaluation=a.bad_version and r == a.rounds))
            rewards = [x["reward"] for x in results]
            entry = rep.version_entry(
                label, rewards, sum(x["samples"] for x in results), lora_name=lora, round_seconds=seconds,
                training_seconds=pending_training["seconds"] if pending_training else None,
                training_run_id=pending_training["training_run_id"] if pending_training else None,
                task_rewards=[round(x, 4) for x in rewards], example=results[0]["answers"][0],
            )
            self.report.versions.append(entry)
            self.report.timings["rounds"].append({"policy": label, "seconds": seconds})
            print(f"  {label}: mean reward {entry['mean_reward']:.3f}, 95% CI [{entry['ci95'][0]:.3f}, "
                  f"{entry['ci95'][1]:.3f}] over {entry['tasks']} Tasks ({entry['samples']} samples) in "
                  f"{seconds:.1f} s; e.g. {entry['example']!r}", flush=True)
            self.report.write(final=False)
            if r < a.rounds:
                with self.stage(f"training run {r + 1}/{a.rounds}", self.run_dir / "gateway" / "rl-service.log"):
                    pending_training = self.train(r, lora)

    def timed(self, step: str, run: Callable[[], list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], float]:
        """One batch of Tasks as the named step (its log: the gateway's): its results and its seconds."""
        with self.stage(step, self.run_dir / "gateway" / "gateway.log"):
            t = time.monotonic()
            results = run()
            return results, round(time.monotonic() - t, 2)

    def calculator_rounds(self) -> None:
        """Evaluate base on the held-out problems (evaluation Tasks), then per round: training Tasks on fresh train
        problems, a Training Run, activation, and the new version's evaluation on the SAME held-out problems."""
        a = self.args
        held_out = calc.problems("held-out", a.eval_tasks, 0)  # fixed: every seed and version sees these
        train = calc.problems("train", a.tasks * max(1, a.rounds), a.seed)
        pending_training: dict[str, Any] | None = None
        for r in range(a.rounds + 1):
            lora = self.calls.active_policy()
            label = policy_label(lora)
            results, seconds = self.timed(f"evaluation {r + 1}/{a.rounds + 1} (policy {label})",
                                          lambda: self.run_round(r, lora, label, held_out, evaluation=True))
            entry = self.calculator_entry(label, lora, results, seconds, pending_training)
            self.report.versions.append(entry)
            self.report.timings["rounds"].append({"policy": label, "kind": "evaluation", "seconds": seconds})
            print(f"  {label} (held-out): success {entry['success_rate']:.3f} [{entry['success_ci95'][0]:.3f}, "
                  f"{entry['success_ci95'][1]:.3f}], shaped reward {entry['mean_reward']:.3f} over "
                  f"{entry['tasks']} Tasks in {seconds:.1f} s; e.g. {entry['example']!r}", flush=True)
            self.report.write(final=False)
            if r == a.rounds:
                break
            batch = train[r * a.tasks:(r + 1) * a.tasks]
            results, seconds = self.timed(f"training round {r + 1}/{a.rounds} (policy {label})",
                                          lambda: self.run_round(r, lora, label, batch, evaluation=False))
            succ = [1.0 if x["success"] else 0.0 for x in results]
            rewards = [x["reward"] for x in results]
            self.report.training_rounds.append({"policy": label, "tasks": len(results), "seconds": seconds,
                                                "success_rate": round(sum(succ) / len(succ), 4),
                                                "mean_reward": round(sum(rewards) / len(rewards), 4)})
            self.report.timings["rounds"].append({"policy": label, "kind": "training", "seconds": seconds})
            print(f"  training round {r + 1} ({label}): success {sum(succ) / len(succ):.3f}, shaped reward "
                  f"{sum(rewards) / len(rewards):.3f} over {len(results)} Tasks in {seconds:.1f} s", flush=True)
            with self.stage(f"training run {r + 1}/{a.rounds}", self.run_dir / "gateway" / "rl-service.log"):
                pending_training = self.train(r, lora)

    def calculator_entry(self, label: str, lora: str | None, results: list[dict[str, Any]], seconds: float,
                         pending: dict[str, Any] | None) -> dict[str, Any]:
        return rep.success_entry(
            label, lora, results, seconds, pending,
            activation_latency_s=pending.get("first_served_s") if pending else None,
            reasons=rep.reason_counts(results),
            answers=[{"question": x["question"], "answer": x["answer"], "completions": x["answers"],
                      "tool_result": x["feedback"], "success": x["success"], "reward": x["reward"]}
                     for x in results])

    def run_round(self, r: int, lora: str | None, label: str, problems: list[Any] | None = None,
                  evaluation: bool = False, *, count: int | None = None, invert: bool = False,
                  candidate: str | None = None, title: str | None = None) -> list[dict[str, Any]]:
        """One batch of Tasks. `invert`: publish 1 - reward (the deliberately bad training round); `candidate`: a
        canary's candidate, to which a Task may be pinned instead of `lora`."""
        a = self.args
        count = (a.tasks if count is None else count) if problems is None else len(problems)
        kind = "evaluation" if evaluation else "round" if problems is None else "training"
        # Training rounds are counted like the Training Runs they feed; evaluations and rounds per version.
        step = f"training round {r + 1}/{a.rounds}" if kind == "training" else f"{kind} {r + 1}/{a.rounds + 1}"
        bar = Bar(title or f"{step} ({label})", total=count, unit="tasks")
        self.executor = futures.ThreadPoolExecutor(max_workers=a.concurrency, thread_name_prefix="agent")
        results: list[dict[str, Any]] = []
        pins = {lora or BASE_POLICY, candidate or lora or BASE_POLICY}
        try:
            if problems is None:
                pending = {self.executor.submit(self.run_task, r, i, lora, pins, invert, evaluation)
                           for i in range(count)}
            else:
                pending = {self.executor.submit(self.run_calculator_task, r, i, p, lora, evaluation, pins, invert)
                           for i, p in enumerate(problems)}
            while pending:
                done, pending = futures.wait(pending, timeout=1.0, return_when=futures.FIRST_COMPLETED)
                for fut in done:
                    results.append(fut.result())  # a Task's failure fails the round
                if done:
                    mean = sum(x["reward"] for x in results) / len(results)
                    if problems is None:
                        bar.update(len(done), f"mean reward {mean:.3f}")
                    else:
                        rate = sum(1 for x in results if x["success"]) / len(results)
                        bar.update(len(done), f"success {rate:.3f}, reward {mean:.3f}")
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)
            bar.close()
        results.sort(key=lambda x: x["task"])
        with open(self.run_dir / "agents.jsonl", "a") as f:
            for x in results:
                f.write(json.dumps(x) + "\n")
        return results

    def run_task(self, r: int, i: int, lora: str | None, pins: set[str], invert: bool = False,
                 evaluation: bool = False) -> dict[str, Any]:
        a = self.args
        session = f"demo-r{r}-t{i}-{secrets.token_hex(3)}"
        t = time.monotonic()
        task_id, pinned = self.start_task(session, lora, pins, evaluation)
        messages: list[dict[str, str]] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        answers: list[str] = []
        for turn in range(a.turns):
            out = self.stack.agent.chat.completions.create(
                model=a.model_id, messages=messages, max_tokens=a.max_tokens, temperature=1.0,
                seed=sampling_seed(a.seed, r, i, turn),
                extra_headers={"X-Agent-Session-Id": session},
            )
            text = out.choices[0].message.content or ""
            answers.append(text)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
        self.stop_task(task_id)
        reward = word_char_share(answers)
        rewarded = self.calls.publish_reward(task_id, 1.0 - reward if invert else reward)
        return {"round": r, "task": i, "rl_task_id": task_id, "policy": pinned, "answers": answers,
                "reward": reward, "samples": rewarded.get("sample_count", 0),
                "seconds": round(time.monotonic() - t, 3)}

    def start_task(self, session: str, lora: str | None, pins: set[str], evaluation: bool) -> tuple[str, str | None]:
        """(Task id, pinned version) of a signed Task start with a terminal reward, its pin checked against `pins`.
        An evaluation Task's samples are counted per version and never trained on."""
        body: dict[str, Any] = {"reward_mode": "terminal", **({"evaluation": True} if evaluation else {})}
        started = self.stack.signed(*routes.TASK_START.at(), json_body=body,
                                    headers={"X-Agent-Session-Id": session}, agent=True)
        if started.status_code != 201:
            raise DemoFailed(f"Task start answered {started.status_code}: {started.text[:300]}")
        task = started.json()
        return task["rl_task_id"], self.check_pin(task, lora, pins)

    def stop_task(self, task_id: str) -> None:
        stopped = self.stack.signed(*routes.TASK_STOP.at(task_id), agent=True)
        if stopped.status_code != 200 or stopped.json().get("status") != "finalized":
            raise DemoFailed(f"Task {task_id} stop answered {stopped.status_code}: {stopped.text[:300]}")

    @staticmethod
    def check_pin(task: dict[str, Any], lora: str | None, pins: set[str]) -> str | None:
        pinned = task.get("policy_lora_name")
        if (pinned or BASE_POLICY) not in pins:
            raise DemoFailed(f"Task {task['rl_task_id']} is pinned to {pinned}, expected "
                             f"{' or '.join(sorted(pins)) if len(pins) > 1 else lora or 'base'}")
        return pinned

    def run_calculator_task(self, r: int, i: int, problem: calc.Problem, lora: str | None, evaluation: bool,
                            pins: set[str], invert: bool = False) -> dict[str, Any]:
        """One tool-using agent Task: question → calculator call (completion 1) → the agent runs the tool and sends
        the result → final answer (completion 2) → success and shaped reward from the text → signed reward."""
        a = self.args
        kind = "e" if evaluation else "t"
        session = f"demo-{kind}{r}-{i}-{secrets.token_hex(3)}"
        t = time.monotonic()
        task_id, pinned = self.start_task(session, lora, pins, evaluation)
        messages = calc.first_messages(problem)
        answers: list[str] = []
        feedback = ""
        for turn in range(2):
            # No per-request `seed`: vLLM 0.32's CPU sampler fails ("CPU Generator does not use offset") when a
            # seeded request's prompt is prefilled in chunks, which these longer prompts trigger under load.
            out = self.stack.agent.chat.completions.create(
                model=a.model_id, messages=messages, max_tokens=a.max_tokens, temperature=1.0,
                extra_headers={"X-Agent-Session-Id": session},
            )
            text = out.choices[0].message.content or ""
            answers.append(text)
            if turn == 0:
                _, feedback = calc.tool_call(text)  # the agent runs the tool
                messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": feedback}]
        self.stop_task(task_id)
        scored = calc.score(problem, answers)
        rewarded = self.calls.publish_reward(task_id, 1.0 - scored.reward if invert else scored.reward)
        return {"round": r, "task": i, "rl_task_id": task_id, "policy": pinned, "evaluation": evaluation,
                "question": problem.question, "answer": problem.answer, "split": problem.split,
                "answers": answers, "feedback": feedback, "success": scored.success, "reward": scored.reward,
                "reason": scored.reason, "samples": rewarded.get("sample_count", 0),
                "seconds": round(time.monotonic() - t, 3)}

    def train(self, r: int, parent: str | None, *, candidate_only: bool = False,
              title: str | None = None) -> dict[str, Any]:
        """Start a Training Run and watch it to its end. Under --bad-version (rollout.mode canary) its version is a
        candidate first: the demo promotes it as an operator would, unless `candidate_only` (the bad version)."""
        a = self.args
        bar = Bar(title or f"training run {r + 1}/{a.rounds}", total=3, unit="stages")
        t = time.monotonic()
        try:
            started = self.stack.signed(*routes.RUN_START.at())
            if started.status_code != 201:
                raise DemoFailed(f"POST /v1/rl/training/runs answered {started.status_code}: {started.text[:300]}")
            run_id = started.json()["training_run_id"]
            reached = 0
            activating_at: float | None = None
            last_training_seen: float | None = None
            while True:
                got = self.stack.signed(*routes.RUN.at(run_id))
                if got.status_code != 200:
                    raise DemoFailed(f"GET run {run_id} answered {got.status_code}: {got.text[:300]}")
                run = got.json()
                status, stage = run["status"], run.get("stage")
                if stage == "training" and status not in TERMINAL_RUN:
                    last_training_seen = time.monotonic()
                elif activating_at is None and last_training_seen is not None:
                    # The activation request was sent after the last poll that still saw `training`: from there,
                    # the latency below is an upper bound (polls are 0.2 s apart).
                    activating_at = last_training_seen
                level = 3 if status == "succeeded" else {"training": 1, "activating": 2}.get(stage or "", 0)
                if level > reached:
                    bar.update(level - reached, status if status in TERMINAL_RUN else f"{stage or status}")
                    reached = level
                else:
                    bar.note(f"{stage or status} ({time.monotonic() - t:.0f} s)")
                if status in TERMINAL_RUN:
                    break
                if time.monotonic() - t > a.train_timeout:
                    raise DemoFailed(f"Training Run {run_id} not finished within {a.train_timeout:.0f} s "
                                     f"(status {status}, stage {stage})")
                self.stack.check("gateway")
                time.sleep(0.2)
        finally:
            bar.close()
        succeeded_at = time.monotonic()
        seconds = round(succeeded_at - t, 2)
        if status != "succeeded":
            raise DemoFailed(f"Training Run {run_id} ended {status}: {run.get('failure_reason')}")
        if a.bad_version:
            self.calls.wait_candidate(run["lora_name"])
            if candidate_only:
                record = {"training_run_id": run_id, "parent": parent or BASE_POLICY, "lora_name": run["lora_name"],
                          "sample_count": run["sample_count"], "seconds": seconds, "candidate": True,
                          "steps": run.get("metrics", {}).get("steps")}
                self.report.timings["training_runs"].append(record)
                print(f"  {run['lora_name']} trained on {run['sample_count']} samples in {seconds:.1f} s: now the "
                      "canary's candidate", flush=True)
                return record
            promoted = self.stack.signed(*routes.ROLLOUT_PROMOTE.at())
            if promoted.status_code != 200:
                raise DemoFailed(f"POST /v1/rl/rollout/promote answered {promoted.status_code}: "
                                 f"{promoted.text[:300]}")
        now_active = self.calls.active_policy()
        if now_active != run["lora_name"]:
            raise DemoFailed(f"Training Run {run_id} succeeded with {run['lora_name']} but the gateway's active "
                             f"policy is {now_active}")
        steps = run.get("metrics", {}).get("step_metrics") or []
        first_served = self.first_served(run["lora_name"], activating_at)
        record = {"training_run_id": run_id, "parent": parent or BASE_POLICY, "lora_name": run["lora_name"],
                  "sample_count": run["sample_count"], "seconds": seconds,
                  "activation_s": None if activating_at is None else round(succeeded_at - activating_at, 2),
                  "first_served_s": first_served,
                  "steps": run.get("metrics", {}).get("steps"),
                  "step_metrics": steps}
        self.report.timings["training_runs"].append(record)
        print(f"  {run['lora_name']} trained on {run['sample_count']} samples and activated in {seconds:.1f} s",
              flush=True)
        return record

    def first_served(self, lora_name: str, activating_at: float | None) -> float | None:
        """Seconds from the last poll that saw the run still training (polls 0.2 s apart, so an upper bound of the
        time from the activation request) to the first completion vLLM serves with the new adapter (asked directly
        by its LoRA name); None when vLLM is given."""
        if self.stack.vllm_port is None or activating_at is None:
            return None
        import httpx

        with httpx.Client(timeout=60, trust_env=False) as http:
            r = http.post(f"http://127.0.0.1:{self.stack.vllm_port}/v1/completions",
                          json={"model": lora_name, "prompt": "1", "max_tokens": 1})
        if r.status_code != 200:
            raise DemoFailed(f"vLLM did not serve {lora_name} after activation: {r.status_code} {r.text[:200]}")
        return round(time.monotonic() - activating_at, 2)
