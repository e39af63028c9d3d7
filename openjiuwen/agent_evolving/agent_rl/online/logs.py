"""Business logging to the rotating `log_path` only (no propagation to the root logger, CONTRACT §2.1)."""

from __future__ import annotations

import logging
from logging.handlers import RotatingFileHandler
from pathlib import Path

from .config import RLServiceConfig

ROOT_LOGGER = "openjiuwen.agent_rl"
_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


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
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(config.log_level)
    logger.propagate = False
    return logger
