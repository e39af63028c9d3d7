"""The LoRA vocabulary the gateway's LoRA modules share: version names, the active version, the operation error."""

from __future__ import annotations

import re
from dataclasses import dataclass

BASE = "base"  # the policy name of the base model: never a LoRA version, never leased

_LORA_NAME_RE = re.compile(r"(?P<model>.+):v(?P<version>[1-9][0-9]*)")


def parse_lora_name(name: object) -> tuple[str, int] | None:
    """(model, N) of `<model>:vN`, else None."""
    if not isinstance(name, str):
        return None
    match = _LORA_NAME_RE.fullmatch(name)
    if match is None or not match.group("model").strip():
        return None
    return match.group("model"), int(match.group("version"))


def model_of(lora_name: str) -> str | None:
    """The base model a version belongs to; None when `lora_name` is not `<model>:vN`."""
    parsed = parse_lora_name(lora_name)
    return parsed[0] if parsed is not None else None


class LoraError(Exception):
    """A refused or failed LoRA operation; routers turn it into the error envelope as it is."""

    def __init__(self, status: int, code: str, message: str = "") -> None:
        super().__init__(f"{status} {code}: {message or code}")
        self.status = status
        self.code = code
        self.message = message or code


@dataclass(frozen=True, slots=True)
class ActiveLora:
    lora_name: str
    lora_path: str

    def public(self) -> dict[str, str]:
        return {"lora_name": self.lora_name, "lora_path": self.lora_path}
