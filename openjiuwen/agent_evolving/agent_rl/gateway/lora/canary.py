"""The canary candidate of a line: its record, the deterministic split of new Tasks, and its state-file form
(docs/rollout.md, docs/lineages.md, CONTRACT §3.8 ext).

A candidate is a version loaded on every serving instance beside the active one; a fixed share of NEW Tasks is
pinned to it. The split hashes the Task id, so a Task's arm never depends on timing or on which gateway process
pinned it. The RL Service does not recompute it: it reads each Task's arm from the policy the Task was pinned to.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

_SPLIT_PERSON = b"ojrl-canary"  # keyed apart from the routing hash: arms must not correlate with instances


@dataclass(frozen=True, slots=True)
class Candidate:
    lora_name: str
    lora_path: str
    share: float  # of new Tasks, in (0, 1)
    started_at: str
    base_model: str = ""

    def public(self) -> dict[str, Any]:
        return {"lora_name": self.lora_name, "lora_path": self.lora_path, "share": self.share,
                "started_at": self.started_at}

    def entry(self) -> dict[str, Any]:
        """The state-file form."""
        return {**self.public(), "base_model": self.base_model}


def split_point(rl_task_id: str) -> float:
    """The Task's position in [0, 1): uniform over ids, the same on every call."""
    digest = hashlib.blake2b(rl_task_id.encode(), digest_size=8, person=_SPLIT_PERSON).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def in_candidate_arm(rl_task_id: str, share: float) -> bool:
    return split_point(rl_task_id) < share


def parse_share(value: object) -> float:
    """A share strictly between 0 and 1; ValueError otherwise (0 would be no canary, 1 an activation)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("share must be a number")
    share = float(value)
    if not math.isfinite(share) or not 0.0 < share < 1.0:
        raise ValueError("share must be strictly between 0 and 1")
    return share


def parse_candidates(raw: object, parse_name: Any) -> dict[str, Candidate]:
    """The state file's `candidates` object (absent: none). Raises ValueError on a malformed entry: the gateway
    must not guess which version half of its traffic runs."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError("`candidates` is not an object")
    out: dict[str, Candidate] = {}
    for model, entry in raw.items():
        if not isinstance(entry, dict):
            raise ValueError(f"invalid candidate entry for {model!r}")
        name, path = entry.get("lora_name"), entry.get("lora_path")
        parsed = parse_name(name)
        if parsed is None or parsed[0] != model or not isinstance(path, str):
            raise ValueError(f"invalid candidate entry for {model!r}")
        started = entry.get("started_at")
        base = entry.get("base_model")
        out[model] = Candidate(name, path, parse_share(entry.get("share")),
                               started if isinstance(started, str) else "", base if isinstance(base, str) else "")
    return out
