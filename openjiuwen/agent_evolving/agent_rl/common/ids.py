"""Identifier formats, fingerprints and timestamps shared by every layer (CONTRACT conventions)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import orjson

from ..common.policy_names import BASE_POLICY

TASK_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Session ids, capture ids, agent turn ids and rail session/trajectory ids share one format.
TOKEN_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
TRAINING_RUN_ID_RE = re.compile(r"run-[0-9a-f]{12}")
ROLLOUT_ID_RE = re.compile(r"ro-[0-9a-f]{12}")
_LORA_NAME_RE = re.compile(r"(?P<model>.+):v(?P<version>[1-9][0-9]*)")  # the model part is greedy


class InvalidIdentifier(ValueError):
    """A key component or identifier does not match its documented format."""


def is_task_id(value: object) -> bool:
    return isinstance(value, str) and TASK_ID_RE.fullmatch(value) is not None


def _checked(value: object, check: Callable[[object], bool], message: str) -> str:
    """`value` when `check` accepts it; else InvalidIdentifier(message) (the message names the field, never the
    value)."""
    if not check(value):
        raise InvalidIdentifier(message)
    return value  # type: ignore[return-value]


def is_token_id(value: object) -> bool:
    return isinstance(value, str) and TOKEN_ID_RE.fullmatch(value) is not None


def is_run_id(value: object) -> bool:
    return isinstance(value, str) and TRAINING_RUN_ID_RE.fullmatch(value) is not None


def require_task_id(value: object) -> str:
    return _checked(value, is_task_id, "invalid rl_task_id")


def require_token_id(value: object, what: str = "identifier") -> str:
    return _checked(value, is_token_id, f"invalid {what}")


def require_run_id(value: object) -> str:
    return _checked(value, is_run_id, "invalid training_run_id")


def is_rollout_id(value: object) -> bool:
    return isinstance(value, str) and ROLLOUT_ID_RE.fullmatch(value) is not None


def require_rollout_id(value: object) -> str:
    return _checked(value, is_rollout_id, "invalid rollout_id")


MAX_INSTANCE_NAME = 256  # a vLLM instance name, as the gateway accepts it (config or registration)


def is_instance_name(value: object) -> bool:
    """A vLLM instance name: a printable string of 1..256 characters."""
    return isinstance(value, str) and 0 < len(value) <= MAX_INSTANCE_NAME and value.isprintable()


def parse_lora_name(name: object) -> tuple[str, int] | None:
    """(model, N) of a LoRA version name `<model>:vN` (N = `[1-9][0-9]*`, model not blank), else None."""
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


def lora_version(name: str, model_id: str) -> int | None:
    """N of `<model_id>:vN`, else None."""
    parsed = parse_lora_name(name)
    return parsed[1] if parsed is not None and parsed[0] == model_id else None


def is_policy_name(name: object, model_id: str) -> bool:
    return isinstance(name, str) and (name == BASE_POLICY or lora_version(name, model_id) is not None)


def policy_lag_version(name: str, model_id: str) -> int:
    """Version number used for policy lag: base = 0, `<model_id>:vN` = N, anything else = 0."""
    return lora_version(name, model_id) or 0


class NotCanonicalJSON(ValueError):
    """A value JSON cannot carry faithfully here: nesting deeper than 254 levels, or an integer beyond 64 bits."""


def canonical_json(value: Any) -> bytes:
    """Sorted keys, compact separators, non-ASCII kept, UTF-8."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, RecursionError) as exc:
        raise NotCanonicalJSON(str(exc)) from exc


def fingerprint(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def now_iso() -> str:
    return utcnow().isoformat()


def epoch_iso(epoch: float) -> str:
    """The ISO-8601 UTC timestamp of epoch seconds (the inverse of `parse_iso_epoch`)."""
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat()


def parse_iso_epoch(text: str) -> float:
    """Epoch seconds of an ISO-8601 timestamp carrying an offset."""
    dt = datetime.fromisoformat(text)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()
