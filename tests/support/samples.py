"""Reading a stored sample's status the way the service does: through the detail view (the detail route's path)."""

from __future__ import annotations

from openjiuwen.agent_evolving.agent_rl.online.store.sample_documents import SampleDocuments


async def sample_status(documents: SampleDocuments, sample_id: str) -> str | None:
    """The sample's status; None when the id is unknown or malformed."""
    doc = await documents.detail(sample_id)
    return None if doc is None else doc["status"]
