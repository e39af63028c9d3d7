"""The two task families of `--family calculator --lineages 2` and the lineage that learns each: plain data, read by
the stack's configuration (each lineage's `min_pending_samples`) and by the rounds (family_lineages.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import calculator_family as calc
from . import sentiment_family as sent

Complete = Callable[[list[dict[str, str]]], str]


@dataclass(frozen=True)
class Family:
    """A task family as the two-lineage driver uses it: its problems, how an agent plays one, how it is scored."""

    name: str
    module: ModuleType  # the family's module: its `problems` and `score`
    turns: int  # completions per Task (samples it leaves)
    title: str
    reward: str  # the reward in words
    success: str  # what a success is, in words

    def problems(self, split: str, count: int, seed: int) -> list[Any]:
        return self.module.problems(split, count, seed)

    def play(self, problem: Any, complete: Complete) -> tuple[list[str], str]:
        """The agent's side of one Task: (the completions' text, the tool's answer shown to the model or "")."""
        if self.module is sent:
            return [complete(sent.messages(problem))], ""
        first = calc.first_messages(problem)
        call = complete(first)
        _, feedback = calc.tool_call(call)  # the agent runs the tool
        answer = complete([*first, {"role": "assistant", "content": call}, {"role": "user", "content": feedback}])
        return [call, answer], feedback

    def score(self, problem: Any, answers: list[str]) -> Any:
        return self.module.score(problem, answers)


FAMILIES = {
    "calculator": Family("calculator", calc, 2, "word problems with a calculator tool",
                         f"1 for the right final answer, {calc.TOOL_CREDIT} for a right calculator call, else 0",
                         "the right final answer"),
    "sentiment": Family("sentiment", sent, 1, "the sentiment of short reviews (positive or negative)",
                        "1 for the review's label, else 0", "the review's label"),
}


@dataclass(frozen=True)
class FamilyObjective:
    lineage: str
    family: Family

    @property
    def wants(self) -> str:
        return f"success on {self.family.title} ({self.family.reward})"

    @property
    def success_rule(self) -> str:
        return self.family.success


OBJECTIVES = (FamilyObjective("calculator", FAMILIES["calculator"]),
              FamilyObjective("sentiment", FAMILIES["sentiment"]))


def training_samples(tasks: int) -> dict[str, int]:
    """Samples one training round of each lineage leaves pending (one per completion): its `min_pending_samples`."""
    return {o.lineage: tasks * o.family.turns for o in OBJECTIVES}
