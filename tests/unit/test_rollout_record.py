"""The typed rollout record (online/rollout/record.py) reads and writes the stored JSON the untyped dicts wrote:
records stored before the type load, and are written back byte for byte (same keys, same order)."""

from __future__ import annotations

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.rollout.record import LoraRef, Rollout
from openjiuwen.agent_evolving.agent_rl.online.rollout.status import RolloutStatus

# As the dict-built records were stored (rollout/controller.py `begin`, `activate_version`, then `_finish`).
CANARY = {
    "rollout_id": "ro-0123456789ab", "kind": "canary", "mode": "canary", "status": "promoted",
    "candidate": {"lora_name": "m:v2", "lora_path": "/loras/m/v2"},
    "baseline": {"lora_name": "m:v1", "lora_path": "/loras/m/v1"},
    "share": 0.2, "training_run_id": "run-0123456789ab", "created_at": "2026-12-01T00:00:00.000000Z",
    "window_started_at": "2026-12-01T00:00:01.000000Z", "ended_at": "2026-12-01T01:00:00.000000Z",
    "decision": {"action": "promote", "reason": "not_worse", "detail": "d", "by": "auto", "at": "t",
                 "arms": {"candidate": {"tasks": 3}}},
}
LINEAGE_CANARY = {**CANARY, "candidate": {"lora_name": "m:a:v2", "lora_path": "/p"}, "lineage": "a"}
FAILED_ACTIVATION = {
    "rollout_id": "ro-00000000000f", "kind": "activation", "mode": "operator", "status": "failed",
    "candidate": {"lora_name": "m:a:v1", "lora_path": "/loras/m/a/v1"},
    "baseline": {"lora_name": "base", "lora_path": None}, "share": 1.0, "training_run_id": None,
    "created_at": "2026-12-01T00:00:00.000000Z", "window_started_at": "2026-12-01T00:00:00.000000Z",
    "ended_at": "2026-12-01T00:00:02.000000Z",
    "decision": {"action": "activate", "reason": "operator", "by": "operator", "at": "t"},
    "lineage": "a", "error": "gateway refused",
}


@pytest.mark.parametrize("stored", [CANARY, LINEAGE_CANARY, FAILED_ACTIVATION], ids=["default", "lineage", "failed"])
def test_a_record_stored_before_the_type_loads_and_is_written_back_byte_for_byte(stored: dict) -> None:
    raw = orjson.dumps(stored)
    record = Rollout.from_json(raw)
    assert record.to_json() == raw
    assert record.public() == stored  # the API answers the stored form, as before


def test_a_new_record_is_stored_as_the_dict_built_one_was() -> None:
    record = Rollout(rollout_id="ro-0123456789ab", kind="canary", mode="canary", status=RolloutStatus.RUNNING,
                     candidate=LoraRef("m:v2", "/loras/m/v2"), baseline=LoraRef("m:v1", "/loras/m/v1"), share=0.2,
                     training_run_id="run-0123456789ab", created_at="2026-12-01T00:00:00.000000Z",
                     window_started_at="2026-12-01T00:00:01.000000Z")
    assert record.to_json() == orjson.dumps({**CANARY, "status": "running", "ended_at": None, "decision": None})
    assert (record.lineage, record.live, record.deciding, record.canary) == ("default", True, True, True)
    failed = Rollout.from_json(orjson.dumps(FAILED_ACTIVATION))
    assert (failed.lineage, failed.ended, failed.in_flight, failed.baseline) == ("a", True, False, LoraRef("base"))
