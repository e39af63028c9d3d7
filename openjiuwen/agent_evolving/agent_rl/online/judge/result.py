"""What a Judge returns, and the interface capture publication and rail ingestion depend on (CONTRACT §6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

PROMPT_VERSION = "judge-v1"
FAILED_VOTE = "fail"


@dataclass(frozen=True)
class JudgeResult:
    """A successful judgement: `score` in [0, 1]; `votes` holds each vote's `overall` (0–10) or "fail"."""

    score: float
    votes: list[float | str]
    judge_model: str
    prompt_version: str = PROMPT_VERSION

    def as_sample_judge(self, tag: str) -> dict[str, Any]:
        """The sample document's `judge` field; `tag` says which publication path scored it (e.g. `feedback`)."""
        return {
            "score": self.score,
            "source": "judge",
            "tag": tag,
            "votes": list(self.votes),  # a copy: the sample must not share the result's list
            "judge_model": self.judge_model,
            "prompt_version": self.prompt_version,
        }


class Judge(Protocol):
    """Scores one assistant reply. Raises `JudgeFailed` when too few votes succeed."""

    async def score(self, request: dict, response: dict, feedback: str) -> JudgeResult: ...

    async def aclose(self) -> None: ...  # the service closes its Judge on shutdown
