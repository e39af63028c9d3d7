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
])
def test_to_json_is_the_sorted_asdict_encoding(meta):
    raw = meta.to_json()
    assert raw == orjson.dumps(asdict(meta), option=orjson.OPT_SORT_KEYS)
    assert list(orjson.loads(raw)) == sorted(CaptureMeta.__dataclass_fields__)
    assert CaptureMeta.from_json(raw) == meta
