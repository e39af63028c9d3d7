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
