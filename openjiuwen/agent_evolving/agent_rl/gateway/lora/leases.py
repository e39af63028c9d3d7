"""Leases: how many Tasks are pinned to each LoRA version (CONTRACT §3.4). A leased version stays loaded; the caller
unloads a version whose last lease it dropped. Base (anything not `<model>:vN`) is never leased."""

from __future__ import annotations

import logging
from collections import Counter

from ...common.ids import parse_lora_name
from ...common.lineage import parse_version_name

log = logging.getLogger("openjiuwen.agent_rl.gateway.lora")


class Leases:
    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def acquire(self, lora_name: str) -> None:
        if parse_lora_name(lora_name) is not None:
            self._counts[lora_name] += 1

    def drop(self, lora_name: str) -> bool:
        """Drop one lease; True when it was the version's last."""
        if parse_lora_name(lora_name) is None:
            return False
        count = self._counts.get(lora_name, 0)
        if count <= 0:
            log.warning("release of %s without a lease", lora_name)
            return False
        if count > 1:
            self._counts[lora_name] = count - 1
            return False
        del self._counts[lora_name]
        return True

    def count(self, lora_name: str) -> int:
        return self._counts.get(lora_name, 0)

    def names(self) -> set[str]:
        return {name for name, n in self._counts.items() if n > 0}

    def counts(self, line: str | None = None) -> dict[str, int]:
        """Lease count per leased version, by name (of the versions of `line` only, when given)."""
        return {name: n for name, n in sorted(self._counts.items())
                if n > 0 and (line is None or _line(name) == line)}


def _line(name: str) -> str | None:
    parsed = parse_version_name(name)
    return parsed[0] if parsed is not None else None
