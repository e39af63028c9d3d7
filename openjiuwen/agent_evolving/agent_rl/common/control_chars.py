"""Control characters made visible, for text an outside party wrote that ends up in a log or on a terminal (issue 28
items 5 and 6).

A line break in such text forges a log record; ESC and the C1 controls drive the terminal that shows it (move the
cursor, clear the screen, retitle the window, hide what follows); bidirectional overrides show characters in another
order than they are stored. Each is replaced by a backslash escape: `\\n`, `\\r`, `\\t`, `\\xNN` up to U+00FF,
`\\uNNNN` above. Everything else, non-ASCII text included, is kept as it is. A backslash already in the text is kept
too: the result cannot be read back unambiguously, but it can no longer start a line or drive a terminal.
"""

from __future__ import annotations

import functools

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# C0, DEL, C1; the Unicode line and paragraph separators (line breaks to many readers); bidirectional formatting.
_CONTROLS = (
    [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029, 0x061C, 0x200E, 0x200F,
     *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
)


def _escape(code: int) -> str:
    char = chr(code)
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


@functools.lru_cache(maxsize=8)
def _table(keep: str) -> dict[int, str]:
    return {code: _escape(code) for code in _CONTROLS if chr(code) not in keep}


def escape_controls(text: str, *, keep: str = "") -> str:
    """`text` with every control character escaped, except those in `keep` (e.g. "\\n\\t" for multi-line text
    meant for humans)."""
    return text.translate(_table(keep))
