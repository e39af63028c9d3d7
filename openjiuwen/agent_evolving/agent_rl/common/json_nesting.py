"""The nesting bound of every JSON body either process reads (issue 28 item 8).

orjson reads up to 1024 levels but writes at most 254, and what a process reads it writes again, one or more levels
deeper: the gateway puts a client's request inside its hook body, the RL Service stores it inside its documents and
quotes it to the Judge. A request nested a little less than 254 levels was read, then failed where it was written,
as a 500 with a traceback. Every body is therefore held to MAX_DEPTH levels when it is read: far above any real
request (tool schemas, content parts and metadata nest a few dozen levels at most), far below what any later
wrapping reaches.

Depth counts containers: `1` and `"x"` are 0 levels, `[]` and `{}` 1, `{"a": [1]}` 2.

The check sits on every captured completion's path (a 2,048-token logprobs body opens thousands of containers, never
deep), so it must cost next to nothing (issue 38): a long document is parsed inside wrappers that make orjson's own
depth limit the bound (`_loads_wrapped`), a short one is settled by counting its brackets or scanning its text
(`text_exceeds`). The walk over a parsed value (`nesting_exceeds`) is the reference both are tested against.
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
    """`orjson.loads` that also raises TooDeep past `max_depth` levels (orjson's own bound of 1024 included).

    A long document is parsed inside wrapper lists that leave orjson's reader exactly `max_depth` levels to go
    (`_loads_wrapped`): the parser itself enforces the bound, for a fixed cost. A short one is parsed as it is and
    then checked (`check_depth`: two counts, or the scan of its text)."""
    if len(data) > _WRAP_FROM and _READER_DEPTH is not None and max_depth < _READER_DEPTH:
        return _loads_wrapped(data, max_depth)
    value = _loads_plain(data, max_depth)
    check_depth(value, max_depth=max_depth, text=data)
    return value


def _loads_plain(data: bytes | str, max_depth: int) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        if "depth" in exc.msg:  # orjson's "depth limit exceeded": the same refusal, with our wording
            raise TooDeep(max_depth) from None
        raise


def _reader_depth() -> int | None:
    """The deepest document orjson reads (1024 since orjson 3.9.15), checked on this orjson; None when it is not
    exactly that, and the wrapped parse is then never used."""
    limit = 1024
    try:
        orjson.loads(b"[" * limit + b"]" * limit)
    except orjson.JSONDecodeError:
        return None
    try:
        orjson.loads(b"[" * (limit + 1) + b"]" * (limit + 1))
    except orjson.JSONDecodeError as exc:
        return limit if "depth" in exc.msg else None
    return None


_READER_DEPTH = _reader_depth()
# From this length on the wrapped parse (a fixed ~0.1 ms: the wrapper levels built, checked and freed) costs less
# than scanning the text (about 1.5-3 us per KiB, the more the more escapes).
_WRAP_FROM = 48 * 1024


def _loads_wrapped(data: bytes | str, max_depth: int) -> Any:
    """Parse `data` as the only element of `_READER_DEPTH - max_depth` nested lists: orjson refuses the whole past
    its reader's depth exactly when the document nests deeper than `max_depth`. When every wrapper holds exactly one
    element, the document between them is one valid JSON value (its own closing brackets cannot stand for the
    wrappers': those are the text's last characters); anything else is parsed again alone, to fail as it does."""
    assert _READER_DEPTH is not None
    wrappers = _READER_DEPTH - max_depth
    if isinstance(data, str):
        wrapped: bytes | str = "".join(("[" * wrappers, data, "]" * wrappers))
    else:
        wrapped = b"".join((b"[" * wrappers, data, b"]" * wrappers))
    try:
        value = orjson.loads(wrapped)
    except orjson.JSONDecodeError as exc:
        if "depth" in exc.msg:
            raise TooDeep(max_depth) from None
    else:
        for _ in range(wrappers):
            if len(value) != 1:
                break
            value = value[0]
        else:
            return value
    _loads_plain(data, max_depth)  # raises: the document is not valid JSON on its own
    raise orjson.JSONDecodeError("JSON document did not parse inside its wrapper", "", 0)  # never reached: fail closed


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
