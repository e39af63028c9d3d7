"""`openjiuwen-rl demo --lineages 2` on SmolLM2 (`make demo-real DEMO_ARGS="--lineages 2"`): two lineages learn two
different task families at once on one base model, one gateway and one vLLM, and the cross table shows what each
lineage's training did to both families (issue 27 item 8).

- Lineage `calculator` runs the calculator family (`calculator_family.py`: a tool call, then the answer; reward 1
  for the right answer, 0.3 for a right tool call) and lineage `sentiment` the review-sentiment family
  (`sentiment_family.py`: one completion; reward 1 for the review's label, else 0). Both rewards measure success.
- The rounds are those of `lineages.TwoLineages`: every lineage's held-out evaluation Tasks (the same problems for
  every version, never trained on), every lineage's training Tasks on fresh train problems, all interleaved on one
  pool of agents; each lineage's Training Run is started by the RL Service's automatic training (never by the
  driver), each Task is pinned to its own line's active version.
- After the last round, the cross evaluation: each lineage's last version on the OTHER family's held-out problems
  (evaluation Tasks of that lineage, so they are pinned to its version and never trained on). Base on each family is
  the round-0 evaluation (both lines start at base).

The end: one table per lineage, then the cross table (rows: base and each lineage's last version; columns: the two
families' held-out success with its 95 % interval and the gain over base with Welch's interval); `demo-report.json`
carries it under `lineages_cross`.
"""

from __future__ import annotations

import time
from typing import Any

from ..common.policy_names import BASE_POLICY
from . import report as rep
from .family_objectives import FAMILIES, OBJECTIVES
from .lineages import TwoLineages
from .parts import DemoParts


class FamilyLineages(TwoLineages):
    """The rounds of `--family calculator --lineages 2`, then the cross evaluation."""

    OBJECTIVES = OBJECTIVES

    def __init__(self, demo: DemoParts) -> None:
        super().__init__(demo)
        a = self.args
        # Fixed held-out problems (every seed and version sees these) and fresh train problems per round.
        self.held_out = {f.name: f.problems("held-out", a.eval_tasks, 0) for f in FAMILIES.values()}
        self.train = {o.lineage: o.family.problems("train", a.tasks * max(1, a.rounds), a.seed)
                      for o in self.objectives}
        self.cross: dict[str, dict[str, Any]] = {}  # lineage -> its last version's entry on the other family

    def run(self) -> None:
        super().run()
        self.cross_evaluation()

    def cross_evaluation(self) -> None:
        """Each lineage's last version on the other lineage's family: evaluation Tasks of its own lineage (pinned to
        its version, never trained on) with the other family's held-out problems."""
        if len(self.objectives) < 2 or self.args.rounds == 0:
            return
        names = [o.family.name for o in self.objectives]
        families = {o.lineage: names[(k + 1) % len(names)] for k, o in enumerate(self.objectives)}
        actives = {o.lineage: self.active(o.lineage) for o in self.objectives}
        with self.demo.stage("cross evaluation (each lineage's last version on the other family)",
                             self.demo.run_dir / "gateway" / "gateway.log"):
            t = time.monotonic()
            results = self.batch(self.args.rounds, actives, evaluation=True, families=families,
                                 title="cross evaluation (each lineage on the other family)")
            seconds = round(time.monotonic() - t, 2)
        self.demo.report.timings["rounds"].append({"policy": "every lineage", "kind": "evaluation", "seconds": seconds})
        for o in self.objectives:
            entry = self.entry(o, actives[o.lineage], results[o.lineage], seconds, None)
            entry["family"] = families[o.lineage]
            self.cross[o.lineage] = entry
            print(f"  {o.lineage} {entry['policy']} on {families[o.lineage]} (held-out): success "
                  f"{entry['success_rate']:.3f} [{entry['success_ci95'][0]:.3f}, {entry['success_ci95'][1]:.3f}]",
                  flush=True)

    def task(self, o: Any, r: int, i: int, lora: str | None, evaluation: bool,
             family: str | None = None) -> dict[str, Any]:
        a, demo = self.args, self.demo
        fam = FAMILIES[family] if family else o.family
        problem = self.held_out[fam.name][i] if evaluation else self.train[o.lineage][r * a.tasks + i]
        session, task_id, pinned = self.start_task(o.lineage, r, i, lora, evaluation)

        def complete(messages: list[dict[str, str]]) -> str:
            # No per-request `seed` (vLLM 0.32's CPU sampler fails on seeded chunked prefills; rounds.py says more).
            out = demo.stack.agent.chat.completions.create(
                model=a.model_id, messages=messages, max_tokens=a.max_tokens, temperature=1.0,
                extra_headers={"X-Agent-Session-Id": session})
            return out.choices[0].message.content or ""

        answers, feedback = fam.play(problem, complete)
        scored = fam.score(problem, answers)
        rewarded = self.stop_and_reward(task_id, scored.reward)
        return {"lineage": o.lineage, "family": fam.name, "round": r, "task": i, "evaluation": evaluation,
                "rl_task_id": task_id, "policy": pinned, "question": problem.question, "answer": problem.answer,
                "answers": answers, "feedback": feedback, "reward": scored.reward, "success": scored.success,
                "reason": scored.reason, "samples": rewarded.get("sample_count", 0)}

    def entry(self, o: Any, lora: str | None, results: list[dict[str, Any]], seconds: float,
              trained: dict[str, Any] | None) -> dict[str, Any]:
        entry = super().entry(o, lora, results, seconds, trained)
        entry["reasons"] = rep.reason_counts(results)
        entry["answers"] = [{"question": x["question"], "answer": x["answer"], "completions": x["answers"],
                             "success": x["success"], "reward": x["reward"]} for x in results]
        return entry

    # ------------------------------------------------------------------------------------------ report

    def cross_table(self) -> dict[str, Any]:
        """Rows base and each lineage's last version; per family its held-out success, interval and gain over base
        (Welch). Base on a family is the round-0 evaluation of the lineage that owns the family."""
        own = {o.family.name: self.tables[o.lineage] for o in self.objectives}
        base = {name: versions[0] for name, versions in own.items() if versions}
        rows: list[dict[str, Any]] = [{"row": BASE_POLICY, "families": {
            name: _cell(entry, None) for name, entry in base.items()}}]
        for o in self.objectives:
            versions = self.tables[o.lineage]
            if len(versions) < 2 or o.lineage not in self.cross:
                continue
            last, other = versions[-1], self.cross[o.lineage]
            cells = {o.family.name: _cell(last, base.get(o.family.name)),
                     other["family"]: _cell(other, base.get(other["family"]))}
            rows.append({"row": f"{o.lineage} {last['policy']}", "lineage": o.lineage,
                         "lora_name": last["lora_name"], "families": cells})
        return {"families": list(own), "rows": rows}

    def report(self) -> dict[str, Any]:
        out = super().report()
        for o in self.objectives:
            out[o.lineage]["family"] = o.family.name
        return out

    def cross_report(self) -> dict[str, Any] | None:
        return self.cross_table() if self.cross else None

    def text(self) -> str:
        parts = [super().text()]
        cross = self.cross_report()
        if cross:
            parts += ["", cross_text(cross)]
        return "\n".join(parts)


def _cell(entry: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    cell: dict[str, Any] = {"policy": entry["policy"], "success_rate": entry["success_rate"],
                            "success_ci95": entry["success_ci95"], "tasks": entry["tasks"]}
    if base is not None:
        gain, (lo, hi) = rep.diff_ci95(base["task_success"], entry["task_success"])
        cell["gain_over_base"] = round(gain, 4)
        cell["gain_ci95"] = [round(lo, 4), round(hi, 4)]
    return cell


def cross_text(cross: dict[str, Any]) -> str:
    """The cross table: one row per policy, per family its success [interval] and the gain over base [interval]."""
    families, cell = cross["families"], 44
    title = "held-out success"
    width = max(len(title), *(len(r["row"]) for r in cross["rows"]))
    head = f"{title:<{width}}" + "".join(f"  {name:<{cell}}" for name in families)
    lines = ["cross table: each lineage's last version on both families (gain over base, 95% CI)", head.rstrip(),
             "-" * len(head.rstrip())]
    for row in cross["rows"]:
        cells = []
        for name in families:
            c = row["families"].get(name)
            if c is None:
                cells.append(f"  {'-':<{cell}}")
                continue
            lo, hi = c["success_ci95"]
            text = f"{c['success_rate']:.3f} [{lo:.3f}, {hi:.3f}]"
            if "gain_over_base" in c:
                glo, ghi = c["gain_ci95"]
                text += f" {c['gain_over_base']:+.3f} [{glo:+.3f}, {ghi:+.3f}]"
            cells.append(f"  {text:<{cell}}")
        lines.append(f"{row['row']:<{width}}" + "".join(cells).rstrip())
    return "\n".join(lines)
