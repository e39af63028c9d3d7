"""`openjiuwen-rl rl traj reward` and the reward part of `traj stats` (signed requests to a fake gateway)."""

from __future__ import annotations

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.cli.operator import main
from tests.unit.test_operator_cli import FakeGateway, error, ok, run_cli


@pytest.fixture
def gw() -> FakeGateway:
    return FakeGateway()


def test_traj_reward_posts_the_source_and_score(gw: FakeGateway, capsys) -> None:
    answer = {"trajectory_id": "c1", "source": "human", "score": 0.25, "recorded": True, "status": "pending",
              "rewards": {"score": 0.5, "aggregation": "weighted_mean", "sources": {}, "waiting_for": {}}}
    gw.on("POST", "/v1/rl/trajectories/c1/rewards", ok(answer),
          error(409, "reward_conflict", "reward source human already has a different score"))
    assert run_cli(gw, "traj", "reward", "c1", "human", "0.25") == 0
    assert orjson.loads(gw.requests[-1].content) == {"source": "human", "score": 0.25}
    assert capsys.readouterr().out == "sample c1: human 0.25 recorded; status pending, score 0.5\n"
    assert run_cli(gw, "traj", "reward", "c1", "human", "0.3") == 1
    assert "409 reward_conflict" in capsys.readouterr().err


def test_stats_show_waiting_samples_and_lateness(gw: FakeGateway, capsys) -> None:
    stats = {"total": 3, "by_status": {"awaiting_rewards": 1, "pending": 2, "training": 0, "trained": 0, "failed": 0},
             "by_source": {"rl_task": 3}, "stale": 0, "expired_unrewarded": 0, "updated_at": "2025-01-01T00:00:00Z",
             "rewards": {"aggregation": "last", "waiting": 1, "next_deadline_at": "2025-01-02T00:00:00Z",
                         "dropped": 0, "sources": {
                             "human": {"arrived": 2, "fallback": 0, "late_p50_seconds": 60.0,
                                       "late_p95_seconds": 3600.5},
                             "business": {"arrived": 0, "fallback": 1, "late_p50_seconds": None,
                                          "late_p95_seconds": None}}}}
    gw.on("GET", "/v1/rl/trajectories/stats", ok(stats))
    assert run_cli(gw, "traj", "stats") == 0
    out = capsys.readouterr().out
    assert "awaiting_rewards 1, pending 2" in out
    assert "last; waiting 1, dropped 0, next deadline 2025-01-02T00:00:00Z\n" in out
    assert "human" in out and "arrived 2, fallback 0, late p50 60 s, p95 3600.5 s\n" in out
    assert "arrived 0, fallback 1, late -\n" in out


def test_reward_help_and_usage(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["traj", "reward", "--help"], env={})
    assert done.value.code == 0 and "external reward source" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["traj", "reward", "c1", "human", "lots"], env={})
    assert done.value.code == 2
