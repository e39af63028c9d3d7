"""Building the sample document of a committed capture (CONTRACT §4.5), directly in its packed form."""

from __future__ import annotations

from typing import Any

from ...common.lineage import DEFAULT_LINEAGE
from ...common.sampling import Sampling
from ..store.codec import PackedSample
from ..store.documents import sample_document
from ..tasks.task_records import Task
from .response import ValidatedResponse


def stripped_response(response: dict[str, Any]) -> dict[str, Any]:
    """The response without the three token arrays, which are stored once, packed (a packed `:after` body's
    response comes without them already)."""
    out = {k: v for k, v in response.items() if k != "prompt_token_ids"}
    choice = {k: v for k, v in response["choices"][0].items() if k not in ("token_ids", "logprobs")}
    out["choices"] = [choice]
    return out


def build_sample(
    task: Task,
    *,
    capture_id: str,
    agent_turn_id: str | None,
    request: dict[str, Any],
    response: dict[str, Any],
    validated: ValidatedResponse,
    instance: str | None = None,
) -> PackedSample:
    """`instance`: the vLLM instance that served it, when the gateway said (an operator may exclude its samples)."""
    message = validated.choice["message"]
    # `response_text` is not stored: it is the response's content (codec.derive_response_text), restored on read.
    trajectory: dict[str, Any] = {"tool_calls": message.get("tool_calls") or []}
    if validated.routed_experts is not None:
        trajectory["routed_experts"] = validated.routed_experts
    if validated.routing_metadata is not None:
        trajectory["routing_metadata"] = validated.routing_metadata
    meta = sample_document(
        sample_id=capture_id,
        rl_task_id=task.rl_task_id,
        agent_turn_id=agent_turn_id,
        session_id=task.agent_session_id,
        model_id=task.model_id,
        policy_version=task.policy_lora_name,
        source="rl_task",
        mode="gateway",
        io_mode="gateway",
        turn_num=0,
        request=request,
        response=stripped_response(response),
        trajectory=trajectory,
    )
    # The effective sampling (the injected request names every field): the trainers train the sample at it.
    meta["sampling"] = Sampling.of_request(request).record()
    meta["judge"] = None
    if instance is not None:
        meta["instance"] = instance
    if task.lineage != DEFAULT_LINEAGE:
        meta["lineage"] = task.lineage  # the store files it on its lineage's line; absent for default (unchanged)
    if task.evaluation:
        meta["evaluation"] = True  # the store files it under `evaluation`: measured, never trained on
    return PackedSample(meta, validated.prompt_ids, validated.response_ids, validated.logprobs)
