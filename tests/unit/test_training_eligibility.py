"""Automatic training's choice (training/eligibility.py): which lines start now, why, and in which order."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.online.training import eligibility as el
from openjiuwen.agent_evolving.agent_rl.online.training.eligibility import LineState, choose, judge_line, rank
from openjiuwen.agent_evolving.agent_rl.online.training.training_policy import TrainingPolicyConfig

NOW = 10_000.0


def policy(**kw) -> TrainingPolicyConfig:
    return TrainingPolicyConfig(**{"auto": True, "min_pending_samples": 8, **kw})


def line(name="tiny", *, eligible=8, waited=10.0, **kw) -> LineState:
    return LineState(line=name, lineage="default", pending=kw.pop("pending", eligible), eligible=eligible,
                     oldest_at=None if waited is None else NOW - waited, last_end_at=kw.pop("last_end_at", None), **kw)


def test_min_pending_threshold_makes_a_line_eligible_and_one_below_does_not():
    at = judge_line(line(eligible=8), policy(), NOW)
    assert (at.eligible, at.reason, at.min_samples) == (True, el.MIN_PENDING, 8)
    below = judge_line(line(eligible=7), policy(), NOW)
    assert (below.eligible, below.reason) == (False, el.TOO_FEW)


def test_stale_samples_do_not_count():
    assert not judge_line(line(pending=20, eligible=7), policy(), NOW).eligible


def test_max_wait_trains_a_smaller_batch_above_the_floor_only():
    p = policy(max_wait_seconds=60, min_batch_on_wait=3)
    due = judge_line(line(eligible=3, waited=60), p, NOW)
    assert (due.eligible, due.reason, due.min_samples) == (True, el.MAX_WAIT, 3)
    early = judge_line(line(eligible=3, waited=59), p, NOW)
    assert (early.eligible, early.reason, early.next_eligible_at) == (False, el.WAITING, NOW + 1)
    under_floor = judge_line(line(eligible=2, waited=600), p, NOW)
    assert (under_floor.eligible, under_floor.reason) == (False, el.TOO_FEW)


def test_min_interval_counts_from_the_previous_run_end():
    p = policy(min_interval_seconds=30)
    blocked = judge_line(line(last_end_at=NOW - 29), p, NOW)
    assert (blocked.eligible, blocked.reason, blocked.next_eligible_at) == (False, el.INTERVAL, NOW + 1)
    assert judge_line(line(last_end_at=NOW - 30), p, NOW).eligible


@pytest.mark.parametrize(("change", "reason"), [
    ({"paused": True}, el.PAUSED),
    ({"active_run": "run-000000000001"}, el.RUN_ACTIVE),
    ({"rollout_deciding": True}, el.ROLLOUT_DECIDING),
])
def test_pause_active_run_and_deciding_canary_block(change, reason):
    verdict = judge_line(line(eligible=100, **change), policy(), NOW)
    assert (verdict.eligible, verdict.reason) == (False, reason)


def test_auto_off_never_starts():
    assert choose([line(eligible=100)], TrainingPolicyConfig(), NOW, active_runs=0) == []


def test_no_pending_sample_is_not_eligible_even_with_a_floor_of_one():
    verdict = judge_line(line(eligible=0, waited=None), policy(max_wait_seconds=1), NOW)
    assert (verdict.eligible, verdict.reason) == (False, el.NO_SAMPLES)


def test_equal_shares_go_longest_waiting_first_and_at_most_max_concurrent():
    lines = [line("a", waited=5), line("b", waited=50), line("c", waited=20), line("d", eligible=1, waited=99)]
    two = policy(max_concurrent_runs=2)
    picked = choose(lines, two, NOW, active_runs=0)
    assert [v.line for v in picked] == ["b", "c"]
    assert [v.line for v in choose(lines, two, NOW, active_runs=1)] == ["b"]
    assert choose(lines, two, NOW, active_runs=2) == []
    assert [v.line for v in choose(lines, policy(), NOW, active_runs=0)] == ["b"]


def test_a_lineage_override_applies_to_its_own_line_only():
    p = policy(lineages={"up": {"min_pending_samples": 2}, "off": {"auto": False}})

    def of(lineage: str, eligible: int) -> LineState:
        return LineState(line=f"tiny:{lineage}", lineage=lineage, pending=eligible, eligible=eligible,
                         oldest_at=NOW - 10, last_end_at=None)

    up = judge_line(of("up", 2), p, NOW)
    assert (up.eligible, up.reason, up.min_samples) == (True, el.MIN_PENDING, 2)
    down = judge_line(of("down", 2), p, NOW)  # no override: the top-level threshold of 8
    assert (down.eligible, down.reason, down.min_samples) == (False, el.TOO_FEW, 8)
    assert judge_line(of("off", 50), p, NOW).reason == el.AUTO_OFF
    assert judge_line(line(eligible=2), p, NOW).reason == el.TOO_FEW  # the default line keeps the top level


def test_an_override_waits_its_own_interval_and_max_wait():
    p = policy(min_interval_seconds=0, lineages={"slow": {"min_interval_seconds": 100, "max_wait_seconds": 5}})
    slow = LineState(line="tiny:slow", lineage="slow", pending=1, eligible=1, oldest_at=NOW - 10,
                     last_end_at=NOW - 50)
    assert (judge_line(slow, p, NOW).reason, judge_line(slow, p, NOW).next_eligible_at) == (el.INTERVAL, NOW + 50)
    later = judge_line(slow, p, NOW + 60)
    assert (later.eligible, later.reason, later.min_samples) == (True, el.MAX_WAIT, 1)
    fast = LineState(line="tiny:fast", lineage="fast", pending=1, eligible=1, oldest_at=NOW - 10,
                     last_end_at=NOW - 50)
    assert judge_line(fast, p, NOW).reason == el.TOO_FEW  # no max_wait at the top level


def test_choose_picks_the_longest_waiting_under_each_lines_own_policy():
    p = policy(lineages={"up": {"min_pending_samples": 2}})
    states = [LineState(line="tiny:up", lineage="up", pending=2, eligible=2, oldest_at=NOW - 30, last_end_at=None),
              LineState(line="tiny:down", lineage="down", pending=2, eligible=2, oldest_at=NOW - 90,
                        last_end_at=None),  # waited longer, but below its (top-level) threshold
              line(eligible=8, waited=20)]
    assert [v.line for v in choose(states, p, NOW, active_runs=0)] == ["tiny:up"]


def test_the_smallest_fair_share_tag_goes_first_whatever_the_backlog():
    """Fair by policy, not by backlog: `flood` waited longest and holds the most, but its tag is past the clock."""
    flood = line("tiny:flood", pending=30, eligible=30, waited=600, share_tag=7.0)
    meek = line("tiny:meek", eligible=8, waited=1, share_tag=6.0)
    also = line("tiny:also", eligible=8, waited=2, share_tag=6.0)
    assert [v.line for v in rank([flood, meek, also], policy(), NOW)] == ["tiny:also", "tiny:meek", "tiny:flood"]
    assert [v.share_tag for v in rank([flood, meek], policy(), NOW)] == [6.0, 7.0]


def test_the_runs_per_hour_quota_holds_a_line_until_its_oldest_counted_start_leaves_the_hour():
    p = policy(lineages={"busy": {"max_runs_per_hour": 2}})

    def busy(*starts: float) -> LineState:
        return LineState(line="tiny:busy", lineage="busy", pending=9, eligible=9, oldest_at=NOW - 10,
                         last_end_at=None, recent_starts=starts)

    held = judge_line(busy(NOW - 100, NOW - 3000), p, NOW)  # newest first: two within the hour
    assert (held.eligible, held.reason, held.next_eligible_at) == (False, el.QUOTA, NOW - 3000 + 3600)
    assert judge_line(busy(NOW - 100), p, NOW).eligible  # one run left in the quota
    assert judge_line(busy(NOW - 100, NOW - 3000), p, NOW + 601).eligible  # the older start left the hour
    assert judge_line(busy(NOW - 100, NOW - 3000), policy(), NOW).eligible  # no quota at the top level
    assert el.quota_free_at((NOW - 1, NOW - 2), None, NOW) is None
