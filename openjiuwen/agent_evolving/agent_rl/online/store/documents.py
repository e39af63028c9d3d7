"""The sample document (CONTRACT §4.5), laid out in one place for both ways a sample arrives: a gateway capture
(`capture/sample.py`) and a rail-v1 upload (`rail_ingest/samples.py`). The key order is the stored order of the JSON
part.
"""

from __future__ import annotations

from typing import Any

from ...common.ids import now_iso


def sample_document(
    *,
    sample_id: str,
    rl_task_id: str | None,
    agent_turn_id: str | None,
    session_id: str,
    model_id: str,
    policy_version: str,
    source: str,
    mode: str,
    io_mode: str,
    turn_num: int,
    request: dict[str, Any],
    response: dict[str, Any],
    trajectory: dict[str, Any],
) -> dict[str, Any]:
    """The fields every sample has; each path adds its own after them (`judge`, `evaluation`, `rail_meta`)."""
    return {
        "sample_id": sample_id,
        "trajectory_id": sample_id,  # one sample per trajectory record
        "rl_task_id": rl_task_id,
        "task_id": rl_task_id,
        "agent_turn_id": agent_turn_id,
        "session_id": session_id,
        "user_id": model_id,  # the owner is always the service model; a caller's user id is metadata
        "model": model_id,
        "policy_version": policy_version,
        "source": source,
        "mode": mode,
        "io_mode": io_mode,
        "turn_num": turn_num,
        "created_at": now_iso(),
        "request": request,
        "response": response,
        "trajectory": trajectory,
    }
