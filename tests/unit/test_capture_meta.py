"""Capture metadata is stored as sorted-key JSON (CONTRACT §4.2); the hook scripts compare those exact bytes, so the
encoding must stay what it has always been: `asdict` of the record, keys sorted, compact."""

from __future__ import annotations

from dataclasses import asdict

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.tasks.task_records import CaptureMeta, CaptureStatus


@pytest.mark.parametrize("meta", [
    CaptureMeta("c1", None, "ab" * 32, None, CaptureStatus.OPEN, "2026-01-01T00:00:00.000001+00:00"),
    CaptureMeta("c.1:x", "u-7", "ab" * 32, "packed:" + "cd" * 32, CaptureStatus.COMMITTED,
                "2026-01-01T00:00:00+00:00"),
    CaptureMeta("c1", "ü\"\\", "fp", "r", "committed", "t"),
    CaptureMeta("c1", None, "fp", "r", "committed", "t", samples=3),
])
def test_to_json_is_the_sorted_asdict_encoding(meta):
    """`samples` (issue 35: the samples of an `n` > 1 capture) is written only when set: every capture of one choice
    keeps the bytes it always had."""
    raw = meta.to_json()
    expected = {k: v for k, v in asdict(meta).items() if k != "samples" or v is not None}
    assert raw == orjson.dumps(expected, option=orjson.OPT_SORT_KEYS)
    assert list(orjson.loads(raw)) == sorted(expected)
    assert CaptureMeta.from_json(raw) == meta
