"""Request validation and normalization for captured completions (CONTRACT §4.2)."""

from __future__ import annotations

import hashlib
from typing import Any

from ..errors import invalid_completion
from ...common import sampling
from ...common.ids import NotCanonicalJSON, fingerprint
from ...common.packed_hook import PackedArrays


class RequestModelMismatch(ValueError):
    """`request.model` is not the Task's pinned policy model (a conflict, not an input error)."""



def validate_request(request: Any, *, policy_model: str, delayed: bool, agent_turn_id: str | None) -> None:
    if not isinstance(request, dict):
        raise invalid_completion("request must be an object")
    if not isinstance(request.get("messages"), list):
        raise invalid_completion("request.messages must be a list")
    n = request.get("n")
    if n is not None and (type(n) is not int or n < 1):
        raise invalid_completion("request.n must be absent or a positive integer")
    if not isinstance(request.get("model"), str):
        raise invalid_completion("request.model must be a string")
    try:
        sampling.check(request)
    except sampling.InvalidSampling as exc:
        raise invalid_completion(f"request.{exc}") from None
    if n is not None and n > 1 and request.get("temperature") == 0:
        raise invalid_completion("request.n must be 1 under greedy decoding (temperature 0), as vLLM requires")
    top = request.get("top_logprobs")
    if top is not None and (type(top) is not int or top < -1):
        raise invalid_completion("request.top_logprobs must be absent, null or an integer of at least -1")
    if delayed and agent_turn_id is None:
        raise invalid_completion("agent_turn_id is required for delayed_feedback Tasks")
    if request.get("model") != policy_model:
        raise RequestModelMismatch("request model does not match Task policy")


def normalize_request(request: dict[str, Any]) -> dict[str, Any]:
    """The injected request: a copy of a validated request that names every sampling field (the client's values as
    sent, the neutral defaults for the others: common/sampling.py) and asks vLLM for token ids, sampled-token
    logprobs and, for streams, a usage chunk. `top_logprobs` is the client's when it asked for logprobs, else 0:
    vLLM then reports each sampled token's logprob with no alternatives (`"top_logprobs": []`), which is all a sample
    keeps; one alternative per token made a captured answer ~1.6× larger to send, parse and free. Idempotent, so
    normalizing an already injected request changes nothing. Only top-level keys change (and `stream_options` is
    replaced by a new dict), so a shallow copy leaves the caller's request untouched."""
    injected = dict(request)
    injected.update(sampling.resolved(request))
    wanted = request.get("top_logprobs") if request.get("logprobs") is True else None
    injected["logprobs"] = True
    injected["top_logprobs"] = wanted if wanted is not None else 0
    injected["return_token_ids"] = True
    if injected.get("stream") is True:
        options = injected.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        options["include_usage"] = True
        injected["stream_options"] = options
    return injected


def request_fingerprint(normalized: dict[str, Any]) -> str:
    try:
        return fingerprint(normalized)
    except NotCanonicalJSON as exc:
        raise invalid_completion(f"request cannot be stored: {exc}") from exc


def response_fingerprint(response: dict[str, Any]) -> str:
    try:
        return fingerprint(response)
    except NotCanonicalJSON as exc:
        raise invalid_completion(f"response cannot be stored: {exc}") from exc


def packed_response_fingerprint(response: dict[str, Any], arrays: PackedArrays) -> str:
    """The fingerprint of a packed `:after`'s response: its JSON part and its arrays. It differs from the JSON
    body's for the same completion, so the repeats of one capture use one encoding (the gateway's retries do)."""
    digest = hashlib.sha256(response_fingerprint(response).encode())
    for part in (arrays.prompt_ids, arrays.response_ids, arrays.logprobs):
        digest.update(part)
    return "packed:" + digest.hexdigest()
