"""Trainer backends behind one interface (CONTRACT §7). Heavy libraries load only inside the backend that uses them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ....common.policy_names import BASE_POLICY
from ...lora.repository import Artifact

# Called with each finished PPO step's metrics, as the trainer reports them. A backend that places runs on shared
# resources (verl on Ray) also calls it with `{PLACEMENT: {...}}`, no step: where the run stands in getting its
# resources ("waiting", then "placed"); the runner records that apart from the steps (`metrics.placement`).
OnProgress = Callable[[dict[str, Any]], Awaitable[None]]
PLACEMENT = "placement"


class TrainingCanceled(RuntimeError):
    """`train` ended because its run was canceled through `cancel`."""


@dataclass(frozen=True, slots=True)
class TrainingJob:
    """What one Training Run trains: its claimed samples, on top of the base model or of a parent LoRA version."""

    training_run_id: str
    model_id: str
    base_model_path: str
    samples: Sequence[dict[str, Any]]
    init_lora_name: str  # "base", or the LoRA version training continues from
    init_lora_path: str  # that version's repository directory; "" from the base model
    line: str = ""  # the line whose next version this trains (docs/lineages.md); "" = the model id (default)

    @property
    def from_lora(self) -> bool:
        return self.init_lora_name != BASE_POLICY


class TrainerBackend(Protocol):
    name: str

    async def train(self, job: TrainingJob, *, on_progress: OnProgress) -> Artifact: ...

    async def cancel(self, training_run_id: str) -> bool: ...  # True only once the worker is gone for good

    def check_health(self) -> None: ...  # raises when the backend cannot continue

    async def close(self) -> None: ...
