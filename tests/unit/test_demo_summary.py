"""The demo's closing lines (demo/summary.py): gains over base, which answers are shown side by side, the time."""

from __future__ import annotations

from typing import Any

from openjiuwen.agent_evolving.agent_rl.demo import summary


def version(policy: str, successes: list[bool]) -> dict[str, Any]:
    answers = [{"question": f"Q{i}", "answer": i, "completions": [f"CALL calc({i})", f"ANSWER: {i if ok else -1}"],
                "tool_result": f"RESULT: {i}", "success": ok, "reward": 1.0 if ok else 0.0}
               for i, ok in enumerate(successes)]
    return {"policy": policy, "answers": answers, "task_success": [1.0 if ok else 0.0 for ok in successes]}


def test_every_later_version_gets_its_gain_over_base_with_an_interval() -> None:
    base = version("base", [False, False, True, False])
    v1 = version("v1", [True, False, True, False])
    v2 = version("v2", [True, True, True, True])

    gains = summary.success_gains([base, v1, v2])

    assert [(g["policy"], g["success_minus_base"]) for g in gains] == [("v1", 0.25), ("v2", 0.75)]
    for g in gains:
        lo, hi = g["ci95"]
        assert lo < g["success_minus_base"] < hi
    text = summary.gains_text(gains)
    assert text.splitlines()[1:] == [f"  v1  +0.250  [{gains[0]['ci95'][0]:+.3f}, {gains[0]['ci95'][1]:+.3f}]",
                                     f"  v2  +0.750  [{gains[1]['ci95'][0]:+.3f}, {gains[1]['ci95'][1]:+.3f}]"]


def test_changed_outcomes_are_shown_first_one_that_got_worse_among_them() -> None:
    base = version("base", [True, False, False, False, True, False, False, True])
    last = version("v2", [True, True, False, True, False, True, True, True])

    changes = summary.outcome_changes(base, last)
    shown = summary.examples(changes, 4)

    assert changes == {"wrong → right": [1, 3, 5, 6], "right → wrong": [4], "right in both": [0, 7],
                       "wrong in both": [2]}
    assert shown == [1, 3, 4, 5]  # three that got better and the one that got worse, in held-out order
    text = summary.side_by_side(base, last, 4)
    assert text.splitlines()[0] == ("held-out problems, base vs v2: wrong → right 4, right → wrong 1, "
                                    "right in both 2, wrong in both 1")
    assert [line.strip() for line in text.splitlines() if line.strip().startswith("Q:")] == [
        "Q: Q1 (answer 1)", "Q: Q3 (answer 3)", "Q: Q4 (answer 4)", "Q: Q5 (answer 5)"]


def test_without_changes_the_first_problems_are_shown() -> None:
    base = version("base", [False, True, False])
    last = version("v1", [False, True, False])

    assert summary.examples(summary.outcome_changes(base, last), 2) == [0, 1]


def timings(before: float | None, conversion: float | None) -> dict[str, Any]:
    return {"setup": {"total_s": 30.0 + (conversion or 0.0)},
            "rounds": [{"kind": "evaluation", "seconds": 40.0}, {"kind": "training", "seconds": 80.0},
                       {"kind": "evaluation", "seconds": 100.0}],
            "training_runs": [{"seconds": 90.0}],
            "preparation": {"before_driver_s": before, "model_conversion_s": conversion},
            "demo_seconds": 345.0}


def test_the_time_line_splits_the_demo_by_stage_and_puts_the_preparation_apart() -> None:
    lines = summary.time_text(timings(before=212.4, conversion=35.2)).splitlines()

    assert lines[0] == ("time: the demo 5 min 45 s (set-up 30 s, 2 held-out evaluations 140 s, 1 training rounds "
                        "80 s, 1 Training Runs 90 s)")
    assert lines[1].startswith("preparation, not counted in the demo's time: 3 min 32 s before the driver started")
    assert lines[1].endswith("; 35 s converting SmolLM2 into its cache (first run only)")


def test_no_preparation_line_when_nothing_was_measured() -> None:
    assert summary.time_text(timings(before=None, conversion=None)).splitlines() == [
        "time: the demo 5 min 45 s (set-up 30 s, 2 held-out evaluations 140 s, 1 training rounds 80 s, 1 Training "
        "Runs 90 s)"]
