"""What the gateway's LoRA modules share: the active version and the operation error (version names are parsed by
common/ids.py)."""

from __future__ import annotations

from dataclasses import dataclass

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
