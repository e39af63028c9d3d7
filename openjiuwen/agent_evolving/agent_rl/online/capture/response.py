"""Validation of the complete (or stream-aggregated) OpenAI response given to `:after` (CONTRACT §4.2)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...common.packed_hook import PackedArrays
from ..errors import invalid_completion
from ..store.codec import MAX_TOKEN_ID, pack_ids, pack_logprobs


class ResponseModelMismatch(ValueError):
    """`response.model` is not the Task's pinned policy model."""


@dataclass(slots=True)
class ValidatedChoice:
    """One further choice of an `n` > 1 answer: its arrays in their stored form and its own fields."""

    response_ids: bytes
    logprobs: bytes
    choice: dict[str, Any]
    routed_experts: Any
    routing_metadata: Any


@dataclass(slots=True)
class ValidatedResponse:
    # The three arrays in their stored form (store/codec.py): token ids uint32 LE, logprobs float32 LE.
    prompt_ids: bytes
    response_ids: bytes
    logprobs: bytes
    choice: dict[str, Any]
    routed_experts: Any
    routing_metadata: Any
    # The choices after the first of an `n` > 1 answer (issue 35), in index order: each is a sample of the same prompt.
    others: tuple[ValidatedChoice, ...] = ()



def _packed_token_ids(value: Any, name: str) -> bytes:
    """The ids in their stored form (uint32 LE). The common valid list takes C loops only: a type set, then the
    packing itself, which refuses an id outside uint32 (OverflowError). Anything else takes the loop below, which
    alone decides the error."""
    if not isinstance(value, list) or not value:
        raise invalid_completion(f"{name} must be a non-empty list of non-negative integers")
    if set(map(type, value)) == {int}:
        try:
            return pack_ids(value)
        except OverflowError:
            pass
    for x in value:
        # `type(x) is int` rejects bool (a subclass of int) in the same check; the upper bound is the packed
        # storage's (uint32), far above any vocabulary, and a larger id would otherwise fail only when stored.
        if type(x) is not int or not 0 <= x <= MAX_TOKEN_ID:
            raise invalid_completion(f"{name} must be a non-empty list of integers in 0..{MAX_TOKEN_ID}")
    return pack_ids(value)


def _logprobs(value: Any, expected: int) -> list[float]:
    if not isinstance(value, dict) or not isinstance(value.get("content"), list):
        raise invalid_completion("choices[0].logprobs.content must be a list")
    fast = _logprobs_fast(value["content"], expected)
    if fast is not None:
        return fast
    out: list[float] = []
    isfinite = math.isfinite
    for entry in value["content"]:
        lp = entry.get("logprob") if isinstance(entry, dict) else None
        if type(lp) is int:
            lp = float(lp)
        if type(lp) is not float or not isfinite(lp) or lp > 0:
            raise invalid_completion("every logprob must be a finite number <= 0")
        out.append(lp)
    if len(out) != expected:
        raise invalid_completion("logprobs are not aligned with the completion token ids")
    return out


def _logprobs_fast(content: list[Any], expected: int) -> list[float] | None:
    """The logprobs when every entry is a dict whose `logprob` is a float, all finite and <= 0, and their count is
    `expected` (`logprobs_valid`); else None (the caller's per-entry loop then finds the exact error, or converts
    int logprobs)."""
    try:
        out = [entry["logprob"] for entry in content]
    except (TypeError, KeyError):  # a non-dict entry or a missing `logprob`
        return None
    if len(out) != expected or set(map(type, out)) != {float}:
        return None
    return out if logprobs_valid(out) else None


def logprobs_valid(logprobs: Sequence[float]) -> bool:
    """Every logprob finite and <= 0, in C loops: a NaN or an infinity makes the sum non-finite, so `max` is only
    trusted on a finite sum; a finite sequence whose sum overflows is checked element by element."""
    if not logprobs:
        return True
    if math.isfinite(sum(logprobs)):
        return max(logprobs) <= 0
    return all(math.isfinite(x) and x <= 0 for x in logprobs)


def _usage_int(usage: dict[str, Any], name: str) -> int:
    value = usage.get(name)
    if type(value) is not int:
        raise invalid_completion(f"usage.{name} must be an integer")
    return value


def _choices(response: Any) -> Any:
    if not isinstance(response, dict):
        raise invalid_completion("response must be an object")
    if response.get("object") != "chat.completion":
        raise invalid_completion("response.object must be chat.completion")
    return response.get("choices")


def _checked_choice(response: Any) -> dict[str, Any]:
    """The response's one choice, after the checks that do not involve the token arrays."""
    choices = _choices(response)
    if not isinstance(choices, list) or len(choices) != 1:
        raise invalid_completion("response must have exactly one choice")
    return _checked_fields(choices[0], 0)


def _checked_fields(choice: Any, position: int) -> dict[str, Any]:
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise invalid_completion(f"choices[{position}].message must be an object")
    finish = choice.get("finish_reason")
    if not isinstance(finish, str) or not finish:
        raise invalid_completion(f"choices[{position}].finish_reason must be a non-empty string")
    return choice


def _checked_choices(response: Any, n: int) -> list[dict[str, Any]]:
    """The `n` choices of an `n` > 1 answer in index order (vLLM numbers them 0 … n-1), each checked as one."""
    choices = _choices(response)
    if not isinstance(choices, list) or len(choices) != n:
        raise invalid_completion(f"response must have exactly {n} choices (request.n)")
    checked = [_checked_fields(choice, i) for i, choice in enumerate(choices)]
    indexes = [choice.get("index") for choice in checked]
    if sorted(i if type(i) is int else -1 for i in indexes) != list(range(n)):
        raise invalid_completion(f"the choices' index values must be 0 … {n - 1}, each once")
    return sorted(checked, key=lambda choice: choice["index"])


def _validated(
    response: dict[str, Any], choice: dict[str, Any], *, prompt_count: int, response_count: int, policy_model: str,
) -> tuple[Any, Any]:
    """Usage against the token counts (`response_count`: of every choice), the model, and the routing fields of
    `choice`: (routed_experts, routing_metadata)."""
    usage = response.get("usage")
    if not isinstance(usage, dict):
        raise invalid_completion("usage must be an object")
    prompt_tokens = _usage_int(usage, "prompt_tokens")
    completion_tokens = _usage_int(usage, "completion_tokens")
    total_tokens = _usage_int(usage, "total_tokens")
    if prompt_tokens != prompt_count or completion_tokens != response_count:
        raise invalid_completion("usage does not match the token ids")
    if total_tokens != prompt_tokens + completion_tokens:
        raise invalid_completion("usage.total_tokens is not the sum of prompt and completion tokens")
    if response.get("model") != policy_model:
        raise ResponseModelMismatch("response model does not match Task policy")
    return _routing(response, choice)


def _routing(response: dict[str, Any], choice: dict[str, Any]) -> tuple[Any, Any]:
    routed = choice.get("routed_experts")
    if routed is None:
        routed = response.get("routed_experts")
    routing = choice.get("routing_metadata")
    if routing is None:
        routing = response.get("routing_metadata")
    return routed, routing


def validate_response(response: Any, *, policy_model: str, n: int = 1) -> ValidatedResponse:
    """`n`: the request's number of choices; each further choice is one more sample of the same prompt."""
    if n > 1:
        return _validate_choices(response, policy_model=policy_model, n=n)
    choice = _checked_choice(response)
    prompt_ids = _packed_token_ids(response.get("prompt_token_ids"), "prompt_token_ids")
    response_ids = _packed_token_ids(choice.get("token_ids"), "choices[0].token_ids")
    response_count = len(response_ids) // 4
    logprobs = _logprobs(choice.get("logprobs"), response_count)
    routed, routing = _validated(response, choice, prompt_count=len(prompt_ids) // 4, response_count=response_count,
                                 policy_model=policy_model)
    return ValidatedResponse(prompt_ids, response_ids, pack_logprobs(logprobs), choice, routed, routing)


def _validate_choices(response: Any, *, policy_model: str, n: int) -> ValidatedResponse:
    choices = _checked_choices(response, n)
    prompt_ids = _packed_token_ids(response.get("prompt_token_ids"), "prompt_token_ids")
    arrays = []
    for i, choice in enumerate(choices):
        ids = _packed_token_ids(choice.get("token_ids"), f"choices[{i}].token_ids")
        arrays.append((ids, _logprobs(choice.get("logprobs"), len(ids) // 4)))
    total = sum(len(ids) for ids, _ in arrays) // 4
    routed, routing = _validated(response, choices[0], prompt_count=len(prompt_ids) // 4, response_count=total,
                                 policy_model=policy_model)
    others = tuple(ValidatedChoice(ids, pack_logprobs(logprobs), choice, *_routing(response, choice))
                   for (ids, logprobs), choice in zip(arrays[1:], choices[1:]))
    first_ids, first_logprobs = arrays[0]
    return ValidatedResponse(prompt_ids, first_ids, pack_logprobs(first_logprobs), choices[0], routed, routing,
                             others)


def validate_packed_response(response: Any, arrays: PackedArrays, *, policy_model: str) -> ValidatedResponse:
    """The same checks for a packed `:after` (common/packed_hook.py): the arrays came as binary, so their ids are
    uint32 by construction and only their counts and the logprobs' values are left to check."""
    choice = _checked_choice(response)
    if "prompt_token_ids" in response or any(k in choice for k in ("token_ids", "logprobs")):
        raise invalid_completion("a packed body carries the token ids and logprobs in its arrays, not in the JSON part")
    if not arrays.prompt_count:
        raise invalid_completion("prompt_token_ids must be a non-empty list of non-negative integers")
    if not arrays.response_count:
        raise invalid_completion("choices[0].token_ids must be a non-empty list of non-negative integers")
    if not logprobs_valid(arrays.logprobs):
        raise invalid_completion("every logprob must be a finite number <= 0")
    routed, routing = _validated(response, choice, prompt_count=arrays.prompt_count,
                                 response_count=arrays.response_count, policy_model=policy_model)
    return ValidatedResponse(arrays.prompt_ids, arrays.response_ids, pack_logprobs(arrays.logprobs), choice, routed,
                             routing)
