"""The second real-model task family of `--lineages 2`, "pick the largest number", and its success-based reward.

A Task is one completion: the user (system prompt + two worked examples) gives a list of distinct integers and asks
for the largest; the model is to reply ``MAX: <number>``. It is a different skill and a different answer format from
the calculator family (`calculator_family.py`), so the two-lineage demo can show what training one lineage on its
family does to the other family.

The reward is task SUCCESS only: 1 when the reply holds exactly one ``MAX:`` followed by exactly one integer and that
integer is the list's largest, else 0. No credit for form.

Anti-gaming rules, each with a unit test (tests/unit/test_largest_family.py):
- two MAX: marks ("MAX: 41 MAX: 97") or several numbers after the mark ("MAX: 97, 41") fail, so listing candidates
  never pays;
- copying the whole list, or answering with a number of the list that is not the largest, fails;
- the number must be an integer on its own ("MAX: 970" is not 97).

Train and held-out prompts never overlap: a list belongs to the held-out split when a hash of its sorted numbers says
so (`split_of`), so no list of the held-out set (in any order) is ever trained on.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = "You find the largest number in a list. Reply with only MAX: and the number."
EXAMPLE = (
    {"role": "user", "content": "Which number is the largest: 23, 71, 8, 45?"},
    {"role": "assistant", "content": "MAX: 71"},
    {"role": "user", "content": "Which number is the largest: 310, 96, 402, 157?"},
    {"role": "assistant", "content": "MAX: 402"},
)
LIST_LENGTH = 4
HELD_OUT_SHARE = 5  # one list in five is held out
MAX_RE = re.compile(r"MAX\s*:", re.IGNORECASE)
INT_RE = re.compile(r"-?\d[\d,]*")


@dataclass(frozen=True)
class Problem:
    question: str
    numbers: tuple[int, ...]
    answer: int
    split: str  # "train" or "held-out"


@dataclass(frozen=True)
class Score:
    success: bool
    reward: float
    final: int | None  # the parsed answer (None: malformed)
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "reward": self.reward, "final": self.final, "reason": self.reason}


def split_of(numbers: tuple[int, ...]) -> str:
    """The split of a list: a stable hash of its sorted numbers (not Python's salted `hash`)."""
    digest = hashlib.sha256(",".join(map(str, sorted(numbers))).encode()).digest()
    return "held-out" if digest[0] % HELD_OUT_SHARE == 0 else "train"


def problems(split: str, count: int, seed: int) -> list[Problem]:
    """`count` distinct lists of `split`, drawn reproducibly from `seed`: `LIST_LENGTH - 1` distinct two-digit
    integers and one three-digit integer (the largest), at a random position (its place tells nothing)."""
    if split not in ("train", "held-out"):
        raise ValueError(f"unknown split {split!r}")
    rng = random.Random(f"largest-family/{split}/{seed}")
    out: list[Problem] = []
    seen: set[tuple[int, ...]] = set()
    while len(out) < count:
        numbers = [*rng.sample(range(10, 100), LIST_LENGTH - 1), rng.randint(100, 999)]
        rng.shuffle(numbers)
        numbers = tuple(numbers)
        key = tuple(sorted(numbers))
        if split_of(numbers) != split or key in seen:
            continue
        seen.add(key)
        question = f"Which number is the largest: {', '.join(map(str, numbers))}?"
        out.append(Problem(question, numbers, max(numbers), split))
    return out


def messages(problem: Problem) -> list[dict[str, str]]:
    """The conversation of the Task's one completion: system prompt, the worked examples, the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, {"role": "user", "content": problem.question}]


def final_answer(text: str) -> tuple[int | None, str]:
    """(number, reason): exactly one MAX: followed by exactly one integer."""
    marks = MAX_RE.findall(text)
    if len(marks) != 1:
        return None, "no MAX:" if not marks else "several MAX:"
    numbers = INT_RE.findall(MAX_RE.split(text, maxsplit=1)[1])
    if len(numbers) != 1:
        return None, "no number after MAX:" if not numbers else "several numbers after MAX:"
    return int(numbers[0].replace(",", "")), "ok"


def score(problem: Problem, answers: list[str]) -> Score:
    """Success (= reward) of one Task from its one completion's text."""
    if not answers:
        return Score(False, 0.0, None, "no completion")
    final, why = final_answer(answers[-1])
    if final is None:
        return Score(False, 0.0, None, why)
    if final == problem.answer:
        return Score(True, 1.0, final, "right answer")
    return Score(False, 0.0, final, "a smaller number of the list" if final in problem.numbers else "wrong answer")
