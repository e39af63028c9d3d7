"""The second real-model task family of `--lineages 2`, "say whether a short review is positive or negative", and
its success-based reward.

A Task is one completion: the user (system prompt + two worked examples) gives a one-sentence review; the model is to
reply ``SENTIMENT: positive`` or ``SENTIMENT: negative``. It is a different skill and a different answer format from
the calculator family (`calculator_family.py`), so the two-lineage demo can show what training one lineage on its
family does to the other family. SmolLM2-135M-Instruct starts near chance on it (about 0.55 held-out success at
temperature 1, most mistakes calling a negative review positive), so there is room to learn.

The reward is task SUCCESS only: 1 when the reply holds exactly one ``SENTIMENT:`` whose label is the review's,
else 0. No credit for form.

Anti-gaming rules, each with a unit test (tests/unit/test_sentiment_family.py):
- both labels after the mark ("SENTIMENT: positive or negative") or two marks fail, so hedging never pays;
- the reviews are balanced (every other problem is positive), so a constant answer earns about one half, the
  chance level the base model starts from;
- the label must be a whole word ("positively" is no label).

Train and held-out prompts never overlap: a review belongs to the held-out split when a hash of its text says so
(`split_of`). The held-out reviews share words with the training ones (the same subjects and adjectives in new
combinations and sentence frames): what is learned is which words make a review positive or negative.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = ("You read a short review and say whether it is positive or negative. Reply with only "
                 "SENTIMENT: positive or SENTIMENT: negative.")
EXAMPLE = (
    {"role": "user", "content": "Review: The pizza was cold and tasteless."},
    {"role": "assistant", "content": "SENTIMENT: negative"},
    {"role": "user", "content": "Review: The garden was beautiful."},
    {"role": "assistant", "content": "SENTIMENT: positive"},
)
SUBJECTS = ("the food", "the hotel room", "the movie", "the service", "the phone", "the book", "the concert",
            "the staff", "the coffee", "the game", "the trip", "the class", "the bus ride", "the museum")
POSITIVE = ("wonderful", "excellent", "great", "delightful", "amazing", "lovely", "fantastic", "superb", "pleasant",
            "perfect", "charming", "impressive")
NEGATIVE = ("terrible", "awful", "horrible", "disappointing", "dreadful", "poor", "boring", "rude", "broken", "bad",
            "annoying", "unpleasant")
FRAMES = ("{S} was {a}.", "Honestly, {s} was {a}.", "I thought {s} was {a}.", "{S} was {a} this time.")
LABELS = ("positive", "negative")
HELD_OUT_SHARE = 5  # one review in five is held out
MARK_RE = re.compile(r"SENTIMENT\s*:", re.IGNORECASE)
WORD_RE = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # "positive" or "negative"
    split: str  # "train" or "held-out"


@dataclass(frozen=True)
class Score:
    success: bool
    reward: float
    final: str | None  # the parsed label (None: malformed)
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "reward": self.reward, "final": self.final, "reason": self.reason}


def split_of(review: str) -> str:
    """The split of a review: a stable hash of its text (not Python's salted `hash`)."""
    return "held-out" if hashlib.sha256(review.encode()).digest()[0] % HELD_OUT_SHARE == 0 else "train"


def problems(split: str, count: int, seed: int) -> list[Problem]:
    """`count` distinct reviews of `split`, drawn reproducibly from `seed`, alternating positive and negative."""
    if split not in ("train", "held-out"):
        raise ValueError(f"unknown split {split!r}")
    rng = random.Random(f"sentiment-family/{split}/{seed}")
    out: list[Problem] = []
    seen: set[str] = set()
    while len(out) < count:
        label = LABELS[len(out) % 2]
        subject = rng.choice(SUBJECTS)
        adjective = rng.choice(POSITIVE if label == "positive" else NEGATIVE)
        text = rng.choice(FRAMES).format(S=subject.capitalize(), s=subject, a=adjective)
        review = f"Review: {text}"
        if split_of(review) != split or review in seen:
            continue
        seen.add(review)
        out.append(Problem(review, label, split))
    return out


def messages(problem: Problem) -> list[dict[str, str]]:
    """The conversation of the Task's one completion: system prompt, the worked examples, the review."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, {"role": "user", "content": problem.question}]


def final_answer(text: str) -> tuple[str | None, str]:
    """(label, reason): exactly one SENTIMENT: followed by exactly one of the two labels as a whole word."""
    marks = MARK_RE.findall(text)
    if len(marks) != 1:
        return None, "no SENTIMENT:" if not marks else "several SENTIMENT:"
    words = [w.lower() for w in WORD_RE.findall(MARK_RE.split(text, maxsplit=1)[1])]
    labels = {w for w in words if w in LABELS}
    if len(labels) != 1:
        return None, "no label after SENTIMENT:" if not labels else "both labels after SENTIMENT:"
    return labels.pop(), "ok"


def score(problem: Problem, answers: list[str]) -> Score:
    """Success (= reward) of one Task from its one completion's text."""
    if not answers:
        return Score(False, 0.0, None, "no completion")
    final, why = final_answer(answers[-1])
    if final is None:
        return Score(False, 0.0, None, why)
    if final == problem.answer:
        return Score(True, 1.0, final, "right answer")
    return Score(False, 0.0, final, "wrong answer")
