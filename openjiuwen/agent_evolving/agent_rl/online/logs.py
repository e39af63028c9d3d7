"""Business logging to the rotating `log_path` only (no propagation to the root logger, CONTRACT §2.1).

`log_format: text` writes `time level logger message`; `log_format: json` writes one JSON object per line with
`time`, `level`, `logger`, `message`, the correlation ids a call passed in `extra` (`rl_task_id`, `capture_id`,
`agent_turn_id`, `training_run_id`, `lora_name`) and `exception` when there is one. Either way the text of a record
has its control characters escaped (common/log_format.py): what a client or an upstream wrote cannot start a record
of its own or drive the terminal of whoever reads the log.

The log names Tasks, runs and failure reasons (which may quote captured text): every file, rotated ones included, is
created 0600 and a missing log directory 0700.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from logging.handlers import RotatingFileHandler
from pathlib import Path

import orjson

from .config import RLServiceConfig
from ..common.control_chars import escape_controls
from ..common.log_format import EscapingFormatter
from ..common.private_files import make_private_dirs, private_opener

ROOT_LOGGER = "openjiuwen.agent_rl"
CORRELATION_FIELDS = ("rl_task_id", "capture_id", "agent_turn_id", "training_run_id", "lora_name")


class PrivateRotatingFileHandler(RotatingFileHandler):
    """A RotatingFileHandler whose files (the first and each one after a rollover) are 0600."""

    def _open(self):  # type: ignore[no-untyped-def]
        return open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors, opener=private_opener)


class JsonFormatter(logging.Formatter):
    """One JSON object per record; correlation ids come from `logger.info(..., extra={"rl_task_id": t})`. Strings
    are escaped as in the text format: JSON escapes only C0, and U+2028 or a C1 control splits or drives as well."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": escape_controls(record.getMessage()),
        }
        for name in CORRELATION_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = escape_controls(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exception"] = escape_controls(self.formatException(record.exc_info), keep="\n")
        return orjson.dumps(entry, default=str).decode()


def configure_logging(config: RLServiceConfig) -> logging.Logger:
    logger = logging.getLogger(ROOT_LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    path = Path(config.log_path).expanduser()
    make_private_dirs(path.parent)
    handler = PrivateRotatingFileHandler(
        path, maxBytes=config.log_max_bytes, backupCount=config.log_backup_count, encoding="utf-8"
    )
    handler.setFormatter(JsonFormatter() if config.log_format == "json" else EscapingFormatter())
    logger.addHandler(handler)
    logger.setLevel(config.log_level)
    logger.propagate = False
    return logger
