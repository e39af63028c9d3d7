"""The trained adapter on disk: the two PEFT files vLLM's /v1/load_lora_adapter reads (CONTRACT §4.8)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def save_peft_adapter(model: Any, out_dir: Path, state_dict: dict[str, Any] | None = None) -> None:
    """`model.save_pretrained` without peft's model card (a README.md that is not part of the adapter)."""
    model.save_pretrained(str(out_dir), state_dict=state_dict)
    (Path(out_dir) / "README.md").unlink(missing_ok=True)
