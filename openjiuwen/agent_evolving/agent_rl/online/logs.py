"""Business logging to the rotating `log_path` only (no propagation to the root logger, CONTRACT §2.1).

`log_format: text` writes `time level logger message`; `log_format: json` writes one JSON object per line with
`time`, `level`, `logger`, `message`, the correlation ids a call passed in `extra` (`rl_task_id`, `capture_id`,
`agent_turn_id`, `training_run_id`, `lora_name`) and `exception` when there is one.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from logging.handlers import RotatingFileHandler
from pathlib import Path

import orjson

from .config import RLServiceConfig

ROOT_LOGGER = "openjiuwen.agent_rl"
_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
CORRELATION_FIELDS = ("rl_task_id", "capture_id", "agent_turn_id", "training_run_id", "lora_name")


class JsonFormatter(logging.Formatter):
    """One JSON object per record; correlation ids come from `logger.info(..., extra={"rl_task_id": t})`."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CORRELATION_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(config: RLServiceConfig) -> logging.Logger:
    logger = logging.getLogger(ROOT_LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    path = Path(config.log_path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = RotatingFileHandler(
        path, maxBytes=config.log_max_bytes, backupCount=config.log_backup_count, encoding="utf-8"
    )
    handler.setFormatter(JsonFormatter() if config.log_format == "json" else logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(config.log_level)
    logger.propagate = False
    return logger
