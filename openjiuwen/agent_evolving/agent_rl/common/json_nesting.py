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

import re
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
    `text`, the JSON it was parsed from (valid JSON, as UTF-8 bytes or str), is scanned instead of walking `value`:
    the same answer (`text_exceeds`) at a fraction of the cost."""
    if nesting_exceeds(value, max_depth) if text is None else text_exceeds(text, max_depth):
        raise TooDeep(max_depth)


# A backslash and the character it escapes: in valid JSON it occurs only inside strings, left to right.
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
# What the scan keeps of the text: quotes, and the brackets as one kind (in valid JSON every closer matches its
# opener, so `[` and `]` stand for both kinds).
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_MARKS = bytes(set(range(256)) - set(b'"[]{}'))
_COUNT_FIRST_UP_TO = 16 * 1024  # bytes


def text_exceeds(text: bytes | str, max_depth: int) -> bool:
    """Whether valid JSON `text` nests deeper than `max_depth` levels; exact, in a few C-level passes over the bytes.

    The walk over a parsed value (`nesting_exceeds`) visited every container in Python: 2 ms for a 2,048-token
    logprobs body, whose thousands of small lists are never deep (issue 38). Here: escapes are dropped (so every
    quote left delimits a string), the text is reduced to its quotes and brackets, the brackets inside strings are
    dropped, and then each `replace("[]", "")` removes exactly the innermost containers, one level a pass, until
    fewer containers are left than levels still allowed. UTF-8 never puts an ASCII byte inside a multi-byte
    character, so the bytes can be read one at a time."""
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogatepass")
    # A document cannot nest deeper than the containers it opens. Two counts settle a short one (a stream's chunk)
    # for less than the passes below cost; a long one goes to them at once (its bracket count is usually above
    # the bound, and the counts would add a third to the scan).
    if len(text) <= _COUNT_FIRST_UP_TO and text.count(b"[") + text.count(b"{") <= max_depth:
        return False
    if b"\\" in text:
        text = _ESCAPE.sub(b"", text)
    marks = text.translate(_AS_BRACKETS, _NOT_MARKS)
    # Two neighbouring quotes enclose no bracket or merge two strings with nothing between them: dropping them keeps
    # every bracket inside or outside a string as it was, and every other quote an opener or a closer as it was.
    marks = marks.replace(b'""', b"")
    if b'"' in marks:  # strings holding brackets: keep what lies outside quote pairs
        marks = b"".join(marks.split(b'"')[::2])
    levels = 0
    while len(marks) // 2 > max_depth - levels:  # more containers left than levels allowed: could be too deep
        if levels == max_depth:
            return True  # a container remains below the deepest allowed level
        marks = marks.replace(b"[]", b"")
        levels += 1
    return False


def nesting_exceeds(value: Any, max_depth: int) -> bool:
    """Whether `value` nests deeper than `max_depth` levels; one breadth-first pass, no recursion. For values
    without their text (and the reference `text_exceeds` is tested against)."""
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
