"""The business log (issue 9): `log_format: json` writes one object per line with the correlation ids."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.config import ConfigError, config_from_mapping
from openjiuwen.agent_evolving.agent_rl.online.logs import ROOT_LOGGER, configure_logging


def config(tmp_path: Path, **extra):
    return config_from_mapping({
        "redis_url": "redis://127.0.0.1:1/0", "model_id": "m", "base_model_path": "/m",
        "lora_repository_path": str(tmp_path / "loras"), "log_path": str(tmp_path / "rl.log"), **extra,
    })


@pytest.fixture
def restore_logger():
    logger = logging.getLogger(ROOT_LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.handlers[:], logger.level, logger.propagate = saved


def test_json_lines_carry_correlation_ids(tmp_path, restore_logger):
    configure_logging(config(tmp_path, log_format="json"))
    log = logging.getLogger(ROOT_LOGGER + ".online.tasks")
    log.info("task %s finalized", "t1", extra={"rl_task_id": "t1", "capture_id": "c1"})
    log.warning("run failed", extra={"training_run_id": "run-0123456789ab"})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("oops")
    lines = [orjson.loads(line) for line in (tmp_path / "rl.log").read_text().splitlines()]
    assert lines[0]["message"] == "task t1 finalized" and lines[0]["level"] == "INFO"
    assert (lines[0]["rl_task_id"], lines[0]["capture_id"], lines[0]["logger"]) == (
        "t1", "c1", "openjiuwen.agent_rl.online.tasks")
    assert lines[0]["time"].endswith("+00:00") and "training_run_id" not in lines[0]
    assert lines[1]["training_run_id"] == "run-0123456789ab"
    assert "ValueError: boom" in lines[2]["exception"]


def test_text_is_the_default(tmp_path, restore_logger):
    configure_logging(config(tmp_path))
    logging.getLogger(ROOT_LOGGER).info("hello", extra={"rl_task_id": "t1"})
    line = (tmp_path / "rl.log").read_text().strip()
    assert line.endswith("INFO openjiuwen.agent_rl hello") and not line.startswith("{")


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="log_format"):
        config(tmp_path, log_format="xml")
