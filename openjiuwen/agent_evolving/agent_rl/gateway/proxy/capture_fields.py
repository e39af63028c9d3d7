"""The request checks inside a Task (issue 35; the field table is in docs/gateway.md "Request fields inside a Task").

An agent must behave the same inside a Task as outside it, so a captured request goes upstream exactly as the client
sent it (only the pinned model, and at `:before` the RL Service's capture flags and explicit neutral sampling values,
are added); the RL Service records in each sample what constrained its sampling (common/constraints.py) and the
training policy decides how it is trained. Nothing is refused or dropped for capture's sake.

What is refused here (400 `invalid_request`, sent nowhere, nothing captured, the Task stays active) is what vLLM
itself would refuse, where the injected flags would otherwise hide the mistake or where it is cheapest to say so
before a capture opens: a sampling value outside vLLM 0.32's ranges (common/sampling.py), an `n` that is not a
positive integer or several choices under greedy decoding, and `top_logprobs` or `logprob_token_ids` without
`logprobs: true` (the RL Service turns `logprobs` on, which would serve a request vLLM refuses outside a Task).
Everything else vLLM refuses reaches it and its 400 is relayed, as outside a Task. Bypass traffic (no Task) is never
checked here.
"""

from __future__ import annotations

from typing import Any

from ...common import sampling
from ...common.sampling import InvalidSampling


class FieldInvalid(ValueError):
    """A request field vLLM would refuse; answered 400 `invalid_request` naming the field as the client named it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} must be {reason}")
        self.field = field


def check_request(request: dict[str, Any]) -> None:
    """Raise FieldInvalid for the first field of a captured `request` vLLM would refuse (a converted Anthropic
    request names the fields checked here as its client did: `temperature`, `top_p`, `top_k`)."""
    for field in sampling.FIELDS:
        try:
            sampling.check_field(field, request.get(field))
        except InvalidSampling as exc:
            raise FieldInvalid(field, exc.reason) from None
    n = request.get("n")
    if n is not None:
        if type(n) is not int or n < 1:
            raise FieldInvalid("n", "a positive integer")
        if n > 1 and request.get("temperature") == 0:
            raise FieldInvalid("n", "1 under greedy decoding (temperature 0): vLLM refuses several greedy choices")
    if request.get("logprobs") is not True:
        top = request.get("top_logprobs")
        if top is not None and top != 0:
            raise FieldInvalid("top_logprobs", "absent or 0 unless logprobs is true")
        if request.get("logprob_token_ids"):
            raise FieldInvalid("logprob_token_ids", "absent unless logprobs is true")
