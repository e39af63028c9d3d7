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


HOSTILE = "tiny\n2026-01-01 00:00:00,000 ERROR openjiuwen.agent_rl forged\r\x1b[2J\x1b]0;owned\x07\x9b31m\u2028\u202e"
ESCAPED = "tiny\\n2026-01-01 00:00:00,000 ERROR openjiuwen.agent_rl forged\\r\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u2028\\u202e"


def hostile_records() -> None:
    """What an outside party controls, in a message and in an exception's text (issue 28 item 5)."""
    log = logging.getLogger(ROOT_LOGGER + ".online.capture")
    log.warning("capture rejected: %s", HOSTILE, extra={"rl_task_id": "t1\x1b[2J"})
    try:
        raise ValueError(HOSTILE)
    except ValueError:
        log.exception("unhandled error on POST /x")


def test_text_records_escape_what_an_outside_party_wrote(tmp_path, restore_logger):
    configure_logging(config(tmp_path))
    hostile_records()
    text = (tmp_path / "rl.log").read_text()
    lines = text.splitlines()  # also splits at U+2028 and the other separators Python knows
    assert lines[0].endswith(f"WARNING openjiuwen.agent_rl.online.capture capture rejected: {ESCAPED}")
    records = [line for line in lines if not line.startswith(" ")]  # traceback lines are indented
    assert len(records) == 2 and records[1].endswith("unhandled error on POST /x"), lines
    # A traceback keeps its line breaks, indented: the forged line is there, but not where records start.
    assert lines[-2:] == ["    ValueError: tiny", "    " + ESCAPED.partition("\\n")[2]]
    assert not any(c in text for c in "\x1b\x07\x9b\r\u2028\u202e")


def test_json_records_escape_what_an_outside_party_wrote(tmp_path, restore_logger):
    configure_logging(config(tmp_path, log_format="json"))
    hostile_records()
    raw = (tmp_path / "rl.log").read_text()
    lines = [orjson.loads(line) for line in raw.splitlines()]
    assert len(lines) == 2
    assert lines[0]["message"] == f"capture rejected: {ESCAPED}" and lines[0]["rl_task_id"] == "t1\\x1b[2J"
    assert lines[1]["exception"].endswith("ValueError: " + ESCAPED.replace("\\n", "\n"))  # JSON escapes that one
    assert not any(c in raw for c in "\x1b\x07\x9b\u2028\u202e")
