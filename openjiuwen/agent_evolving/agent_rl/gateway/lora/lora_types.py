"""What the gateway's LoRA modules share: the active version and the operation error (version names are parsed by
common/ids.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

class LoraStatus(StrEnum):
    """A model's LoRA status in `GET /v1/loras/{model}` (CONTRACT §3.3)."""

    BASE = "base"  # no active version: the base model serves
    ACTIVE = "active"
    DEGRADED = "degraded"  # active, but some instance failed to load it or its artifact is missing


class LoraError(Exception):
    """A refused or failed LoRA operation, named by its contract code; domain_errors.py answers it over HTTP."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message or code}")
        self.code = code
        self.message = message or code


@dataclass(frozen=True, slots=True)
class ActiveLora:
    lora_name: str
    lora_path: str

    def public(self) -> dict[str, str]:
        return {"lora_name": self.lora_name, "lora_path": self.lora_path}
