"""The two-lineage demo's objectives (demo/lineages.py): opposite rewards, each with a success that short answers
cannot reach by saying little."""

from __future__ import annotations

from openjiuwen.agent_evolving.agent_rl.demo.lineages import OBJECTIVES
from openjiuwen.agent_evolving.agent_rl.demo.task_family import MIN_CHARS_PER_ANSWER

PLAIN, SYMBOLS = OBJECTIVES


def test_the_two_objectives_are_opposite_and_each_succeeds_on_its_own_kind():
    words, marks = ["the quiet river runs on"], ["#1! 22?? 3;4: 5%"]
    assert (PLAIN.lineage, SYMBOLS.lineage) == ("plain", "symbols")
    assert PLAIN.success(PLAIN.reward(words)) and not SYMBOLS.success(SYMBOLS.reward(words))
    assert SYMBOLS.success(SYMBOLS.reward(marks)) and not PLAIN.success(PLAIN.reward(marks))
    text = ["abc 12!? def"]  # at the floor's length: the two shares add up to 1
    assert len(text[0]) == MIN_CHARS_PER_ANSWER and abs(PLAIN.reward(text) + SYMBOLS.reward(text) - 1.0) < 1e-9


def test_saying_little_succeeds_for_neither():
    for answers in ([""], ["!"], ["a"], ["", ""]):
        assert not PLAIN.success(PLAIN.reward(answers)) and not SYMBOLS.success(SYMBOLS.reward(answers)), answers


def test_the_two_lineage_demo_trains_every_lineage_automatically_once_a_round_is_pending():
    """The `training_policy` the driver writes under --lineages 2 is one the RL Service accepts, and it makes the
    scheduler train each of the demo's lineages (not only the default line) at exactly one round of samples."""
    from openjiuwen.agent_evolving.agent_rl.demo.stack_config import lineage_training_policy
    from openjiuwen.agent_evolving.agent_rl.online.training.eligibility import LineState, judge_line
    from openjiuwen.agent_evolving.agent_rl.online.training.training_policy import TrainingPolicyConfig

    policy = TrainingPolicyConfig(**lineage_training_policy(192))
    for o in OBJECTIVES:
        state = LineState(line=f"tiny:{o.lineage}", lineage=o.lineage, pending=191, eligible=191, oldest_at=0.0,
                          last_end_at=None)
        assert not judge_line(state, policy, now=10.0).eligible  # a round not yet complete
        full = LineState(line=state.line, lineage=o.lineage, pending=192, eligible=192, oldest_at=0.0,
                         last_end_at=None)
        assert judge_line(full, policy, now=10.0).reason == "min_pending_samples"
