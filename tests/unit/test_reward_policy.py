"""Reward policy logic (docs/rewards.md): config rules, arrivals, deadlines, fallbacks, aggregation. No I/O."""

from __future__ import annotations

from typing import Any

import pytest

from openjiuwen.agent_evolving.agent_rl.online.config import ConfigError, config_from_mapping
from openjiuwen.agent_evolving.agent_rl.online.rewards.config import RewardPolicyConfig
from openjiuwen.agent_evolving.agent_rl.online.rewards.reward_policy import RewardConflict, RewardPolicy

T0 = 1_750_000_000.0
BASE = {"redis_url": "redis://127.0.0.1:1/0", "model_id": "m", "base_model_path": "/b", "lora_repository_path": "/l"}


def policy(aggregation: str = "weighted_mean", **sources: dict[str, Any]) -> RewardPolicy:
    return RewardPolicy(RewardPolicyConfig.model_validate({"aggregation": aggregation, "sources": sources}))


def judged(p: RewardPolicy, score: float = 0.6, source: str = "judge") -> dict[str, Any]:
    return p.initial({"score": score, "source": source, "tag": "feedback"}, T0)


BUSINESS = {"weight": 3.0, "deadline_seconds": 3600, "fallback": "default", "default_score": 0.0}
HUMAN = {"weight": 1.0, "deadline_seconds": 86400, "fallback": "skip"}


# --------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("policy_doc", "problem"),
    [
        ({"sources": {"business": {"weight": 1.0}}}, "deadline_seconds is required"),
        ({"sources": {"judge": {"deadline_seconds": 5}}}, "only weight applies"),
        ({"sources": {"b": {"deadline_seconds": 5, "fallback": "default"}}}, "default_score is required"),
        ({"sources": {"b": {"deadline_seconds": 5, "default_score": 0.5}}}, "default_score is required"),
        ({"sources": {"Bad Name": {"deadline_seconds": 5}}}, "source names"),
        ({"sources": {"b": {"deadline_seconds": 5, "weight": 0}}}, "reward_policy.sources.b.weight"),
        ({"sources": {"b": {"deadline_seconds": 5, "weight": True}}}, "reward_policy.sources.b.weight"),
        ({"sources": {"b": {"deadline_seconds": 0}}}, "reward_policy.sources.b.deadline_seconds"),
        ({"sources": {"b": {"deadline_seconds": 5, "fallback": "default", "default_score": 1.5}}}, "default_score"),
        ({"sources": {"b": {"deadline_seconds": 5, "fallback": "retry"}}}, "fallback"),
        ({"aggregation": "max"}, "reward_policy.aggregation"),
        ({"sources": {}, "extra": 1}, "reward_policy.extra: unknown key"),
    ],
)
def test_invalid_policies_name_the_field(policy_doc: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping({**BASE, "reward_policy": policy_doc})
    assert problem in str(info.value)
    assert "reward_policy" in str(info.value)


def test_absent_policy_is_unconfigured() -> None:
    config = config_from_mapping(BASE)
    assert config.reward_policy is None
    p = RewardPolicy(config.reward_policy)
    assert p.configured is False and p.external == ()
    assert p.status(p.initial({"score": 1.0, "source": "terminal"}, T0)) == "pending"


# --------------------------------------------------------------------------------------------------- states


def test_publication_supplies_its_builtin_source_and_waits_for_external_ones() -> None:
    p = policy(judge={"weight": 1.0}, business=BUSINESS, human=HUMAN)
    state = judged(p)
    assert state["sources"] == {"judge": {"score": 0.6, "at": T0, "kind": "published"}}
    assert (p.status(state), p.open_sources(state)) == ("awaiting_rewards", ["business", "human"])
    assert p.next_deadline(state) == T0 + 3600
    assert state["score"] == 0.6  # the aggregate of what arrived so far


def test_only_builtin_sources_means_pending_at_once() -> None:
    p = policy(terminal={"weight": 2.0})
    state = p.initial({"score": 0.3, "source": "terminal"}, T0)
    assert (p.status(state), p.next_deadline(state)) == ("pending", None)


def test_weighted_mean_over_the_sources_that_arrived() -> None:
    p = policy(judge={"weight": 1.0}, business=BUSINESS, human=HUMAN)
    state = p.arrive(judged(p, 0.6), "business", 1.0, T0 + 60)
    assert state is not None and p.open_sources(state) == ["human"]
    assert state["score"] == pytest.approx((0.6 * 1 + 1.0 * 3) / 4)
    state = p.arrive(state, "human", 0.2, T0 + 7200)
    assert p.status(state) == "pending"
    assert state["score"] == pytest.approx((0.6 + 3.0 + 0.2) / 5)


def test_undeclared_builtin_source_weighs_one() -> None:
    p = policy(business={**BUSINESS, "weight": 1.0})
    state = p.arrive(p.initial({"score": 0.0, "source": "terminal"}, T0), "business", 1.0, T0 + 1)
    assert state is not None and state["score"] == pytest.approx(0.5)


def test_last_lets_a_later_human_review_override_the_judge() -> None:
    p = policy("last", judge={}, human=HUMAN)
    state = p.arrive(judged(p, 0.9), "human", 0.1, T0 + 80000)
    assert state is not None and state["score"] == 0.1
    # Without the review the judge's score stands.
    expired = p.expire(judged(p, 0.9), T0 + 86400)
    assert (expired.state["score"], expired.fallbacks, expired.drop) == (0.9, ("human",), False)


def test_min_takes_the_lowest() -> None:
    p = policy("min", judge={}, business=BUSINESS)
    state = p.arrive(judged(p, 0.7), "business", 0.4, T0 + 5)
    assert state is not None and state["score"] == 0.4


def test_repeat_is_idempotent_and_another_score_conflicts() -> None:
    p = policy(judge={}, business=BUSINESS, human=HUMAN)
    state = p.arrive(judged(p), "business", 0.5, T0 + 1)
    assert state is not None
    assert p.arrive(state, "business", 0.5, T0 + 2) is None
    with pytest.raises(RewardConflict):
        p.arrive(state, "business", 0.6, T0 + 2)
    with pytest.raises(ValueError):
        p.arrive(state, "judge", 0.6, T0 + 2)  # built-in sources are never posted


# --------------------------------------------------------------------------------------------------- deadlines


def test_deadlines_fire_only_when_due_and_each_fallback_applies() -> None:
    p = policy(judge={}, business=BUSINESS, human=HUMAN)
    state = judged(p, 0.6)
    early = p.expire(state, T0 + 3599)
    assert (early.fallbacks, early.state["sources"].keys()) == ((), {"judge"})
    at_business = p.expire(state, T0 + 3600)
    assert at_business.fallbacks == ("business",)
    assert at_business.state["sources"]["business"] == {"score": 0.0, "at": T0 + 3600, "kind": "default"}
    assert at_business.state["score"] == pytest.approx(0.6 / 4)
    assert p.status(at_business.state) == "awaiting_rewards"
    assert p.next_deadline(at_business.state) == T0 + 86400
    done = p.expire(at_business.state, T0 + 86400)
    assert done.state["sources"]["human"]["kind"] == "skipped"
    assert done.state["score"] == pytest.approx(0.6 / 4)  # a skipped source is left out of the mean
    assert p.status(done.state) == "pending"


def test_drop_fallback_drops_the_sample() -> None:
    p = policy(judge={}, audit={"deadline_seconds": 10, "fallback": "drop"})
    assert p.expire(judged(p), T0 + 10).drop is True
    arrived = p.arrive(judged(p), "audit", 1.0, T0 + 3)
    assert arrived is not None and p.status(arrived) == "pending"


def test_a_real_score_replaces_a_fallback() -> None:
    p = policy(judge={}, business=BUSINESS)
    fell_back = p.expire(judged(p, 0.6), T0 + 3600).state
    late = p.arrive(fell_back, "business", 1.0, T0 + 5000)
    assert late is not None and late["sources"]["business"]["kind"] == "arrived"
    assert late["score"] == pytest.approx((0.6 + 3.0) / 4)


def test_view_shows_lateness_and_what_is_still_awaited() -> None:
    p = policy(judge={}, business=BUSINESS, human=HUMAN)
    state = p.arrive(judged(p, 0.6), "business", 1.0, T0 + 90)
    assert state is not None
    view = p.view(state)
    assert view["sources"]["business"] == {"score": 1.0, "kind": "arrived", "late_seconds": 90.0}
    assert view["sources"]["judge"]["late_seconds"] == 0.0
    assert list(view["waiting_for"]) == ["human"] and view["aggregation"] == "weighted_mean"
