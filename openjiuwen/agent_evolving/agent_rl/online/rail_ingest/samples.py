"""One rail-v1 sample of a batch: its checks, then its sample document (CONTRACT §4.6 → §4.5).

Every check raises `InvalidInput(INVALID, …)` naming the field as `samples[<position>]…`; the checks run in the
order below, so a sample with several faults always reports the same first one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInput
from ..store.codec import MAX_TOKEN_ID, PackedSample
from ..store.documents import sample_document

PROTOCOL_VERSION = "rail-v1"
INVALID = "invalid_rail_batch"
MAX_STEP_INDEX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class BatchContext:
    """What a sample document takes from its batch rather than from the sample itself."""

    session_id: str
    trajectory_id: str
    trajectory_meta: dict[str, Any]
    user_id: Any
    tenant_id: Any
    instruction_text: Any


@dataclass(frozen=True, slots=True)
class RailSample:
    """A sample that passed every check, its optional parts defaulted."""

    step: int
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # aligned with response_ids
    response_mask: list[int] | None  # None: all ones
    tools: list[Any]
    response: dict[str, Any]  # the caller's `response` object ({} when absent)
    meta: dict[str, Any]
    response_text: str
    tool_calls: list[Any] | None
    instruction_text: Any


@dataclass(slots=True)
class StagedSample:
    """A sample between its upload and its judging: staged under `<trajectory_id>:<step>` (= its sample id)."""

    sample_id: str
    step: int
    sample: PackedSample


def build_rail_sample(
    batch: BatchContext, raw: Any, position: int, *, model_id: str, policy_version: str, seen_steps: set[int]
) -> StagedSample:
    """The staged form of `raw`, the batch's `position`-th sample."""
    where = f"samples[{position}]"
    sample = check_sample(batch, raw, position, where, seen_steps)
    sample_id = f"{batch.trajectory_id}:{sample.step}"
    packed = PackedSample.from_document(
        rail_document(batch, sample, sample_id, model_id=model_id, policy_version=policy_version)
    )
    try:
        packed.meta_json()  # refuse here, per sample, what JSON cannot carry (nesting, huge integers)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInput(INVALID, f"{where} cannot be stored: {exc}") from exc
    return StagedSample(sample_id, sample.step, packed)


def check_sample(batch: BatchContext, raw: Any, position: int, where: str, seen_steps: set[int]) -> RailSample:
    if not isinstance(raw, dict):
        raise InvalidInput(INVALID, f"{where} must be an object")
    step = _step_index(raw, position, where, seen_steps)
    messages = raw.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise InvalidInput(INVALID, f"{where}.messages must be a non-empty list of objects")
    prompt_ids = _token_ids(raw, "prompt_ids", where)
    response_ids = _token_ids(raw, "response_tokens", where)
    logprobs = _logprobs(raw, len(response_ids), where)
    response_mask = _response_mask(raw, len(response_ids), where)
    tools = raw.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidInput(INVALID, f"{where}.tools must be a list")
    response = _optional_object(raw, "response", where)
    meta = _optional_object(raw, "meta", where)
    expected = raw.get("render_fingerprint_expected", batch.trajectory_meta.get("render_fingerprint_expected"))
    if expected is not None and raw.get("render_fingerprint") is not None and raw["render_fingerprint"] != expected:
        raise InvalidInput(INVALID, f"{where}.render_fingerprint does not match render_fingerprint_expected")
    response_text = _response_text(raw, response, where)
    tool_calls = response.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise InvalidInput(INVALID, f"{where}.response.tool_calls must be a list")
    return RailSample(
        step=step, messages=messages, prompt_ids=prompt_ids, response_ids=response_ids, logprobs=logprobs,
        response_mask=response_mask, tools=tools or [], response=response, meta=meta, response_text=response_text,
        tool_calls=tool_calls, instruction_text=raw.get("instruction_text", batch.instruction_text),
    )


def rail_document(
    batch: BatchContext, sample: RailSample, sample_id: str, *, model_id: str, policy_version: str
) -> dict[str, Any]:
    """The full sample document (arrays as lists); the store packs it."""
    response_in = sample.response
    message: dict[str, Any] = {"role": "assistant", "content": response_in.get("content", sample.response_text)}
    if sample.tool_calls:
        message["tool_calls"] = sample.tool_calls
    usage = response_in.get("usage")
    if not isinstance(usage, dict):
        prompt, completion = len(sample.prompt_ids), len(sample.response_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    trajectory: dict[str, Any] = {
        "prompt_ids": sample.prompt_ids,
        "response_ids": sample.response_ids,
        "response_logprobs": sample.logprobs,
        "response_text": sample.response_text,
        "tool_calls": sample.tool_calls or [],
        "routed_experts": sample.meta.get("routed_experts"),
        "routing_metadata": sample.meta.get("routing_metadata"),
    }
    if sample.response_mask is not None:
        trajectory["response_mask"] = sample.response_mask
    document = sample_document(
        sample_id=sample_id,
        rl_task_id=None,
        agent_turn_id=None,
        session_id=batch.session_id,
        model_id=model_id,
        policy_version=policy_version,
        source="rail",
        mode=PROTOCOL_VERSION,
        io_mode="rail",
        turn_num=sample.step + 1,
        request={"messages": sample.messages, "tools": sample.tools},
        response={
            "object": "chat.completion",
            "model": model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": response_in.get("finish_reason")}],
            "usage": usage,
        },
        trajectory=trajectory,
    )
    instruction_text = sample.instruction_text
    document["rail_meta"] = {
        "protocol_version": PROTOCOL_VERSION,
        "user_id": batch.user_id,
        "tenant_id": batch.tenant_id,
        "sample_meta": sample.meta,
        "trajectory_meta": batch.trajectory_meta,
        "instruction_text": instruction_text if isinstance(instruction_text, str) else None,
    }
    return document


def _step_index(raw: dict[str, Any], position: int, where: str, seen_steps: set[int]) -> int:
    step = raw.get("step_index", position)
    if step is None:
        step = position
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP_INDEX:
        raise InvalidInput(INVALID, f"{where}.step_index must be an integer between 0 and {MAX_STEP_INDEX}")
    if step in seen_steps:
        raise InvalidInput(INVALID, f"{where}.step_index {step} repeats an earlier sample of the batch")
    return step


def _optional_object(raw: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    value = raw.get(name)
    if value is not None and not isinstance(value, dict):
        raise InvalidInput(INVALID, f"{where}.{name} must be an object")
    return value or {}


def _token_ids(raw: dict[str, Any], name: str, where: str) -> list[int]:
    if name not in raw:
        raise InvalidInput(INVALID, f"{where}: missing field: {name}")
    value = raw[name]
    if not isinstance(value, list) or not all(
        type(x) is int and 0 <= x <= MAX_TOKEN_ID for x in value  # bool is not a token id
    ):
        raise InvalidInput(INVALID, f"{where}.{name} must be a list of integers between 0 and {MAX_TOKEN_ID}")
    return value


def _logprobs(raw: dict[str, Any], length: int, where: str) -> list[float]:
    if "logprobs" not in raw:
        raise InvalidInput(INVALID, f"{where}: missing field: logprobs")
    value = raw["logprobs"]
    if not isinstance(value, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value
    ):
        raise InvalidInput(INVALID, f"{where}.logprobs must be a list of finite numbers")
    # Aligned with the response: extra values dropped, missing ones zero-padded (§4.6).
    return [float(x) for x in value[:length]] + [0.0] * max(0, length - len(value))


def _response_mask(raw: dict[str, Any], length: int, where: str) -> list[int] | None:
    value = raw.get("response_mask")
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(x) is int and x in (0, 1) for x in value):
        raise InvalidInput(INVALID, f"{where}.response_mask must be a list of 0 and 1")
    if len(value) != length:
        raise InvalidInput(INVALID, f"{where}.response_mask must have as many entries as response_tokens")
    return None if all(value) else value  # all ones is the default, so it is not stored


def _response_text(raw: dict[str, Any], response: dict[str, Any], where: str) -> str:
    text = raw.get("response_text")
    if text is not None and not isinstance(text, str):
        raise InvalidInput(INVALID, f"{where}.response_text must be a string")
    content = response.get("content")
    if content is not None and not isinstance(content, str):
        raise InvalidInput(INVALID, f"{where}.response.content must be a string")
    return text if text is not None else content or ""
