"""The nesting bound of every JSON body either process reads (issue 28 item 8).

orjson reads up to 1024 levels but writes at most 254, and what a process reads it writes again, one or more levels
deeper: the gateway puts a client's request inside its hook body, the RL Service stores it inside its documents and
quotes it to the Judge. A request nested a little less than 254 levels was read, then failed where it was written,
as a 500 with a traceback. Every body is therefore held to MAX_DEPTH levels when it is read: far above any real
request (tool schemas, content parts and metadata nest a few dozen levels at most), far below what any later
wrapping reaches.

Depth counts containers: `1` and `"x"` are 0 levels, `[]` and `{}` 1, `{"a": [1]}` 2.
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_DEPTH = 128
# A capture hook body carries the client's request (held to MAX_DEPTH by the gateway) and the upstream's response one
# level down: the RL Service reads hook bodies with this much more.
HOOK_WRAPPING = 1


class TooDeep(orjson.JSONDecodeError):
    """A JSON document nested deeper than allowed. A JSONDecodeError, so every reader that refuses malformed JSON
    refuses it too; readers that word their own answer use `str(exc)`, which names the bound."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"JSON nested deeper than {max_depth} levels", "", 0)
        self.max_depth = max_depth

    def __str__(self) -> str:
        return self.msg


def loads(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """`orjson.loads` that also raises TooDeep past `max_depth` levels (orjson's own bound of 1024 included)."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        if "depth" in exc.msg:  # orjson's "depth limit exceeded": the same refusal, with our wording
            raise TooDeep(max_depth) from None
        raise
    check_depth(value, max_depth=max_depth, text=data)
    return value


def check_depth(value: Any, *, max_depth: int = MAX_DEPTH, text: bytes | str | None = None) -> None:
    """Raise TooDeep when `value` (parsed JSON: dicts, lists, scalars) nests deeper than `max_depth` levels.
    `text`, the JSON it was parsed from, lets a document with few brackets skip the walk: it cannot nest deeper than
    the number of containers it opens."""
    if text is not None:
        opens = text.count(b"[") + text.count(b"{") if isinstance(text, bytes) else text.count("[") + text.count("{")
        if opens <= max_depth:
            return
    if nesting_exceeds(value, max_depth):
        raise TooDeep(max_depth)


def nesting_exceeds(value: Any, max_depth: int) -> bool:
    """Whether `value` nests deeper than `max_depth` levels; one breadth-first pass, no recursion."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            return True
        deeper: list[Any] = []
        for container in level:
            items = container.values() if type(container) is dict else container
            kinds = set(map(type, items))  # a list of numbers (token ids) is skipped without a Python-level loop
            if list in kinds or dict in kinds:
                deeper += [item for item in items if type(item) is dict or type(item) is list]
        level = deeper
    return False
