"""The store's side of reward policies: what a sample store asks of one (RewardRules, satisfied by
rewards/reward_policy.RewardPolicy and handed in by the composition root, so the store never imports the rewards package),
and the public view of a recorded reward state."""

from __future__ import annotations

from typing import Any, Protocol

from .sample_status import SampleStatus


class RewardRules(Protocol):
    configured: bool

    def for_lineage(self, lineage: str | None) -> "RewardRules": ...

    def initial(self, judge: Any, now: float) -> dict[str, Any]: ...

    def status(self, state: dict[str, Any]) -> SampleStatus: ...

    def next_deadline(self, state: dict[str, Any]) -> float | None: ...

    def view(self, state: dict[str, Any]) -> dict[str, Any]: ...


def breakdown(state: dict[str, Any], aggregation: str) -> dict[str, Any]:
    """The public view of a state (sample detail `rewards`): the score, and each source with its lateness."""
    published_at = float(state["published_at"])
    return {
        "score": state.get("score"),
        "aggregation": aggregation,
        "sources": {
            name: {"score": e.get("score"), "kind": e["kind"], "late_seconds": round(float(e["at"]) - published_at, 3)}
            for name, e in state["sources"].items()
        },
    }
