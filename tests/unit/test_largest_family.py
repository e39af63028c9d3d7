"""The "pick the largest number" family's reward (the second family of the two-lineage SmolLM2 demo): success only
for the list's largest number after exactly one MAX:, and the gaming attempts a policy could find (listing several
candidates, copying the list, two marks, a number that merely contains the answer) earn nothing. The split never
overlaps."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.demo import largest_family as big

PROBLEM = big.Problem("Which number is the largest: 41, 97, 12, 65?", (41, 97, 12, 65), 97, "train")


@pytest.mark.parametrize("text", ["MAX: 97", "max: 97.", "MAX:97\n", "The answer is MAX: 97"])
def test_the_largest_after_one_mark_is_success(text):
    s = big.score(PROBLEM, [text])
    assert s.success and s.reward == 1.0 and s.final == 97


@pytest.mark.parametrize("text, reason", [
    ("MAX: 65", "a smaller number of the list"),
    ("MAX: 98", "wrong answer"),
    ("MAX: 970", "wrong answer"),
    ("MAX: 97, 65", "several numbers after MAX:"),
    ("MAX: 41, 97, 12, 65", "several numbers after MAX:"),
    ("MAX: 41 MAX: 97", "several MAX:"),
    ("97", "no MAX:"),
    ("MAX: ninety-seven", "no number after MAX:"),
])
def test_anything_else_earns_nothing(text, reason):
    s = big.score(PROBLEM, [text])
    assert not s.success and s.reward == 0.0 and s.reason == reason


def test_no_completion_earns_nothing():
    assert big.score(PROBLEM, []).reward == 0.0


def test_the_splits_never_share_a_list_and_are_reproducible():
    train = big.problems("train", 300, 0)
    held = big.problems("held-out", 64, 0)
    assert {tuple(sorted(p.numbers)) for p in train}.isdisjoint(tuple(sorted(p.numbers)) for p in held)
    assert all(big.split_of(p.numbers) == "held-out" for p in held)
    assert big.problems("held-out", 64, 0) == held and big.problems("train", 300, 1) != train
    assert all(p.answer == max(p.numbers) and len(set(p.numbers)) == big.LIST_LENGTH for p in train + held)


def test_the_largest_is_not_always_in_the_same_place():
    places = {p.numbers.index(p.answer) for p in big.problems("train", 64, 0)}
    assert places == set(range(big.LIST_LENGTH))


def test_an_unknown_split_is_refused():
    with pytest.raises(ValueError):
        big.problems("test", 1, 0)
