"""Building the sample documents of a committed capture (CONTRACT §4.5), directly in their packed form: one sample,
or one per choice of an `n` > 1 answer (issue 35)."""

from __future__ import annotations

from typing import Any

from ...common import constraints
from ...common.lineage import DEFAULT_LINEAGE
from ...common.sampling import Sampling
from ..store.codec import PackedSample
from ..store.documents import sample_document
from ..tasks.task_records import Task
from .response import ValidatedResponse


def choice_sample_id(capture_id: str, index: int) -> str:
    """The sample id of choice `index` of a capture: the capture id itself for the first (so a capture of one choice
    is the sample it always was), `<capture_id>.<index>` for the others."""
    return capture_id if index == 0 else f"{capture_id}.{index}"


def stripped_response(response: dict[str, Any], choice: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response without the three token arrays, which are stored once, packed (a packed `:after` body's
    response comes without them already), and with one choice: `choice`, else the first."""
    out = {k: v for k, v in response.items() if k != "prompt_token_ids"}
    choice = response["choices"][0] if choice is None else choice
    out["choices"] = [{k: v for k, v in choice.items() if k not in ("token_ids", "logprobs")}]
    return out


def sampling_record(request: dict[str, Any]) -> dict[str, Any]:
    """The sample's `sampling`: the effective sampling of the injected request (the trainers train the sample at
    it) and what constrained it (common/constraints.py; the training policy decides by it)."""
    record = Sampling.of_request(request).record()
    record["constraints"] = constraints.of_request(request)
    return record


def build_samples(
    task: Task,
    *,
    capture_id: str,
    agent_turn_id: str | None,
    request: dict[str, Any],
    response: dict[str, Any],
    validated: ValidatedResponse,
    instance: str | None = None,
) -> list[PackedSample]:
    """The samples of one capture, choice 0 first. The choices of an `n` > 1 answer share the prompt, so they form
    one group (`group_uid`, what GRPO normalizes advantages over) and each records its `choice_index`.
    `instance`: the vLLM instance that served it, when the gateway said (an operator may exclude its samples)."""
    sampling = sampling_record(request)
    choices = [(validated.response_ids, validated.logprobs, validated.choice, validated.routed_experts,
                validated.routing_metadata)]
    choices += [(c.response_ids, c.logprobs, c.choice, c.routed_experts, c.routing_metadata) for c in validated.others]
    group = f"{task.rl_task_id}:{capture_id}" if len(choices) > 1 else None
    samples = []
    for index, (response_ids, logprobs, choice, routed, routing) in enumerate(choices):
        message = choice["message"]
        # `response_text` is not stored: it is the response's content (codec.derive_response_text), restored on read.
        trajectory: dict[str, Any] = {"tool_calls": message.get("tool_calls") or []}
        if routed is not None:
            trajectory["routed_experts"] = routed
        if routing is not None:
            trajectory["routing_metadata"] = routing
        meta = sample_document(
            sample_id=choice_sample_id(capture_id, index),
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
            response=stripped_response(response, choice),
            trajectory=trajectory,
        )
        meta["sampling"] = sampling if index == 0 else dict(sampling)
        meta["judge"] = None
        if group is not None:
            meta["group_uid"] = group
            meta["choice_index"] = index
        if instance is not None:
            meta["instance"] = instance
        if task.lineage != DEFAULT_LINEAGE:
            meta["lineage"] = task.lineage  # the store files it on its lineage's line; absent for default (unchanged)
        if task.evaluation:
            meta["evaluation"] = True  # the store files it under `evaluation`: measured, never trained on
        samples.append(PackedSample(meta, validated.prompt_ids, response_ids, logprobs))
    return samples


def build_sample(task: Task, **capture: Any) -> PackedSample:
    """The sample of a capture of one choice (`build_samples`' first)."""
    return build_samples(task, **capture)[0]
