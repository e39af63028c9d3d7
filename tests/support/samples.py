"""Reading a stored sample's status the way the service does: through the detail view (the detail route's path)."""

from __future__ import annotations

from openjiuwen.agent_evolving.agent_rl.online.store.trajectories import TrajectoryStore


async def sample_status(store: TrajectoryStore, sample_id: str) -> str | None:
    """The sample's status; None when the id is unknown or malformed."""
    doc = await store.detail(sample_id)
    return None if doc is None else doc["status"]
