"""The text log format of both processes: one record, one line that only the record starts (issue 28 item 5).

Log messages quote what outside parties wrote: an instance's registration, a vLLM error body, a client's ids, an
exception about a client's input. A raw line break there forged a record of its own (`… ERROR …` at the start of a
line), and ESC sequences rewrote the terminal of whoever tailed the log. `EscapingFormatter` escapes every control
character of the message (common/control_chars.py), so the whole of a record's message sits on its first line; a
traceback or stack keeps its line breaks but is indented, so no line of it can pass for the start of a record.
Escaping at the formatter covers every log call, present and future, without a helper at each call site.
"""

from __future__ import annotations

import logging

from .control_chars import escape_controls

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
DETAIL_INDENT = "    "  # traceback and stack lines of a record: never at column 0, where records start


def escaped_detail(text: str) -> str:
    """A traceback or stack: its controls escaped but its line breaks, each line indented by DETAIL_INDENT."""
    return "\n".join(DETAIL_INDENT + line for line in escape_controls(text, keep="\n").split("\n"))


class EscapingFormatter(logging.Formatter):
    """`logging.Formatter` whose message has its control characters escaped and whose traceback is indented."""

    def __init__(self, fmt: str = LOG_FORMAT) -> None:
        super().__init__(fmt)

    def format(self, record: logging.LogRecord) -> str:
        # Formatter.format, with the message escaped and the details indented; `exc_text` is never cached on the
        # record, so another handler's unescaped rendering cannot be reused here (nor ours there).
        record.message = escape_controls(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        if record.exc_info:
            text += "\n" + escaped_detail(self.formatException(record.exc_info))
        elif record.exc_text:
            text += "\n" + escaped_detail(record.exc_text)
        if record.stack_info:
            text += "\n" + escaped_detail(self.formatStack(record.stack_info))
        return text
