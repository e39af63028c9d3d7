"""The review-sentiment family's reward (the second family of the two-lineage SmolLM2 demo): success only for the
review's own label after exactly one SENTIMENT:, and the gaming attempts a policy could find (both labels, two marks,
a label-like word) earn nothing; a constant answer earns only the chance level. The split never overlaps."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.demo import sentiment_family as sent

NEGATIVE = sent.Problem("Review: The coffee was awful.", "negative", "train")


@pytest.mark.parametrize("text", ["SENTIMENT: negative", "sentiment: Negative.", "SENTIMENT:negative\n",
                                  "The review is SENTIMENT: negative"])
def test_the_right_label_after_one_mark_is_success(text):
    s = sent.score(NEGATIVE, [text])
    assert s.success and s.reward == 1.0 and s.final == "negative"


@pytest.mark.parametrize("text, reason", [
    ("SENTIMENT: positive", "wrong answer"),
    ("SENTIMENT: positive or negative", "both labels after SENTIMENT:"),
    ("SENTIMENT: negative, no wait, positive", "both labels after SENTIMENT:"),
    ("SENTIMENT: negative SENTIMENT: negative", "several SENTIMENT:"),
    ("negative", "no SENTIMENT:"),
    ("SENTIMENT: negatively", "no label after SENTIMENT:"),
    ("SENTIMENT: bad", "no label after SENTIMENT:"),
])
def test_anything_else_earns_nothing(text, reason):
    s = sent.score(NEGATIVE, [text])
    assert not s.success and s.reward == 0.0 and s.reason == reason


def test_no_completion_earns_nothing():
    assert sent.score(NEGATIVE, []).reward == 0.0


def test_a_constant_answer_earns_only_the_chance_level():
    held = sent.problems("held-out", 64, 0)
    for label in sent.LABELS:
        rate = sum(sent.score(p, [f"SENTIMENT: {label}"]).success for p in held) / len(held)
        assert rate == 0.5


def test_the_splits_never_share_a_review_and_are_reproducible():
    train = sent.problems("train", 300, 0)
    held = sent.problems("held-out", 64, 0)
    assert {p.question for p in train}.isdisjoint(p.question for p in held)
    assert all(sent.split_of(p.question) == "held-out" for p in held)
    assert sent.problems("held-out", 64, 0) == held and sent.problems("train", 300, 1) != train
    for p in train + held:  # the label is the adjective's
        words = set(p.question.rstrip(".").replace(",", "").split())
        assert words & set(sent.POSITIVE if p.answer == "positive" else sent.NEGATIVE)


def test_an_unknown_split_is_refused():
    with pytest.raises(ValueError):
        sent.problems("test", 1, 0)
