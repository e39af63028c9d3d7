"""Lineages: named lines of LoRA versions on one base model (docs/lineages.md), and the names derived from them.

A lineage's **line** is the string that names its policy line on a model: the model id itself for the lineage
`default` (so everything of the default lineage is named exactly as before lineages existed) and
`<model_id>:<lineage>` otherwise. Model ids never contain `:` (common/validation.py), so the first `:` of a line
separates the two. A line's LoRA versions are `<line>:v<N>`: `tiny:v3` (default), `tiny:support:v3` (`support`).
Lineage names of the form `v<digits>` are refused: `tiny:v1:v2` would read as a version twice.
"""

from __future__ import annotations

import re

DEFAULT_LINEAGE = "default"
LINEAGE_RE = re.compile(r"[a-z0-9-]{1,63}")
_VERSION_LIKE = re.compile(r"v[0-9]+")
# The version suffix ends the name: a lineage may contain `v<digits>` before a `-` (`v1-x`), so the suffix is the
# last `:v<N>`, never the first one a search meets (issue 37 item 6).
_VERSION_SUFFIX = re.compile(r":v(?P<n>[1-9][0-9]*)\Z")


class InvalidLineage(ValueError):
    """A lineage name, line or LoRA name that does not follow the rules of this module."""


def is_lineage(value: object) -> bool:
    return (isinstance(value, str) and LINEAGE_RE.fullmatch(value) is not None
            and _VERSION_LIKE.fullmatch(value) is None)


def require_lineage(value: object) -> str:
    if not is_lineage(value):
        raise InvalidLineage("a lineage name is 1-63 of lower-case letters, digits and '-', and not 'v' followed "
                             "by digits only")
    return value  # type: ignore[return-value]


def line_of(model_id: str, lineage: str) -> str:
    """The line of `lineage` on `model_id`: the model id for the default lineage, `<model_id>:<lineage>` else."""
    require_lineage(lineage)
    return model_id if lineage == DEFAULT_LINEAGE else f"{model_id}:{lineage}"


def split_line(line: str) -> tuple[str, str]:
    """(model id, lineage) of a line; InvalidLineage when the part after the first `:` is no lineage name."""
    model_id, sep, lineage = line.partition(":")
    if not model_id:
        raise InvalidLineage("a line starts with a model id")
    if not sep:
        return model_id, DEFAULT_LINEAGE
    if lineage == DEFAULT_LINEAGE:  # the default lineage's line is the bare model id, never `<model>:default`
        raise InvalidLineage("the default lineage's line is the model id itself")
    return model_id, require_lineage(lineage)


def lora_name(line: str, version: int) -> str:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidLineage("a version number is a positive integer")
    return f"{line}:v{version}"


def parse_version_name(name: object) -> tuple[str, int] | None:
    """(line, N) of a LoRA version name `<line>:vN` whose line is well formed, else None."""
    if not isinstance(name, str):
        return None
    suffix = _VERSION_SUFFIX.search(name)
    if suffix is None:
        return None
    line = name[:suffix.start()]
    try:
        split_line(line)
    except InvalidLineage:
        return None
    return line, int(suffix.group("n"))


def version_of(name: object, line: str) -> int | None:
    """N of `<line>:vN`, else None (a version of another line, or not a version name)."""
    parsed = parse_version_name(name)
    return parsed[1] if parsed is not None and parsed[0] == line else None


def lineage_of_version(name: object, model_id: str) -> str | None:
    """The lineage a version name of `model_id` belongs to, else None."""
    parsed = parse_version_name(name)
    if parsed is None:
        return None
    model, lineage = split_line(parsed[0])
    return lineage if model == model_id else None
