"""Reading a verdict out of a judge model's free-form answer (CONTRACT §6, parsing)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

DIMENSIONS = ("task_completion", "response_quality", "tool_usage", "coherence")

_FENCED_JSON_RE = re.compile(r"```json[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)
# The stdlib decoder, not orjson: it offers raw_decode, which finds an object's end inside surrounding prose.
_DECODER = json.JSONDecoder()


def parse_verdict(content: str) -> float | None:
    """The verdict's `overall` (0–10 scale as written), or None when the answer holds no usable verdict.

    Candidates, in order: the whole content as JSON, each ```json fenced block, then the first object that decodes
    when scanning from each `{`. A candidate gives `overall` when it is a finite real, else the mean of the
    dimensions present (`<dim>` or `<dim>_score`).
    """
    if not isinstance(content, str):
        return None
    for candidate in _candidates(content):
        verdict = _overall(candidate)
        if verdict is not None:
            return verdict
    return None


def _candidates(content: str) -> Iterator[Any]:
    text = content.strip()
    try:
        yield json.loads(text)
    except ValueError:  # JSONDecodeError is a ValueError; prose around the object is the normal case
        pass
    for block in _FENCED_JSON_RE.findall(content):
        try:
            yield json.loads(block)
        except ValueError:
            continue
    first = _first_embedded_object(content)
    if first is not None:
        yield first


def _first_embedded_object(content: str) -> dict[str, Any] | None:
    start = content.find("{")
    while start != -1:
        try:
            obj, _ = _DECODER.raw_decode(content, start)
            return obj  # starts at `{`, so a successful decode is always an object
        except ValueError:
            start = content.find("{", start + 1)
    return None


def _real(value: Any) -> float | None:
    # bool is an int subclass; `true` is not a score. NaN/Infinity decode from JSON and are rejected too.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float is no score either
        return None
    return number if math.isfinite(number) else None


def _overall(candidate: Any) -> float | None:
    if not isinstance(candidate, dict):
        return None
    overall = _real(candidate.get("overall"))
    if overall is not None:
        return overall
    present = []
    for dim in DIMENSIONS:
        value = _real(candidate.get(dim))
        if value is None:
            value = _real(candidate.get(f"{dim}_score"))
        if value is not None:
            present.append(value)
    return sum(present) / len(present) if present else None
