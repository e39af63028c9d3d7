"""The sampling of a captured completion (issue 29): the client's own sampling fields, which of their values the
trainers reproduce, and their explicit record. Used by the gateway (screening inside a Task), the RL Service (the
injected request and the sample's `sampling` record) and the trainers (the temperature each row is trained at).

A sample is trained as drawn from the policy at its temperature: the trainers compute log softmax(logits / T) over
the whole vocabulary, row by row. Truncation (`top_p` < 1, `top_k` ≥ 1, `min_p` > 0) is forwarded too: vLLM, run
with `--logprobs-mode processed_logprobs`, reports the truncated distribution's logprobs, the trainers measure the
gap to the untruncated policy and correct it by importance sampling (docs/training.md). What the trainers cannot
reproduce is refused: greedy decoding (`temperature` 0), a temperature vLLM would raise to 0.01, and penalties
(verl's engine computes logprobs from the logits and the temperature alone). Values vLLM itself would refuse are
refused as invalid, with vLLM 0.32's ranges.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# vLLM 0.32's own neutral values (ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS; top_k 0 = no limit). A field the
# client did not send gets one explicitly: vLLM would otherwise apply the model's generation_config, which neither
# the gateway nor the RL Service can see, and the sample would record a sampling that was not used.
DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
}
FIELDS = tuple(DEFAULTS)
MIN_TEMPERATURE = 0.01  # vLLM raises any temperature in (0, 0.01) to 0.01 (SamplingParams.__post_init__)
MAX_TEMPERATURE = 2.0

GREEDY_REASON = ("temperature 0 is greedy decoding: every token is the argmax, so the sample has no exploration and "
                 "no policy-gradient signal (send a temperature of at least 0.01)")
LOW_TEMPERATURE_REASON = ("vLLM raises a temperature below 0.01 to 0.01, so the sample would not record the sampling "
                          "used (send 0.01 or more)")
PENALTY_REASON = ("the trainers compute the policy's logprobs without penalties (verl's engine has no place for "
                  "them), so a penalized sample would be trained as drawn from another policy")


class SamplingRefused(ValueError):
    """A sampling field a captured request cannot carry. `invalid`: vLLM itself would refuse the value (a client
    mistake anywhere); otherwise the value is valid but its sample could not be trained correctly."""

    def __init__(self, field: str, reason: str, *, invalid: bool) -> None:
        message = f"{field} must be {reason}" if invalid else f"{field} is not allowed in a captured request: {reason}"
        super().__init__(message)
        self.field = field
        self.reason = reason
        self.invalid = invalid


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def check_field(field: str, value: Any) -> None:
    """Raise SamplingRefused when `value` (None = not sent) of the sampling `field` cannot be captured."""
    if value is None:
        return
    if field == "top_k":
        if type(value) is not int or value < -1:
            raise SamplingRefused(field, "an integer, -1 or 0 (no limit) or at least 1", invalid=True)
        return
    if not _number(value):
        raise SamplingRefused(field, "a finite JSON number", invalid=True)
    if field == "temperature":
        if not 0 <= value <= MAX_TEMPERATURE:
            raise SamplingRefused(field, "in [0, 2]", invalid=True)
        if value == 0:
            raise SamplingRefused(field, GREEDY_REASON, invalid=False)
        if value < MIN_TEMPERATURE:
            raise SamplingRefused(field, LOW_TEMPERATURE_REASON, invalid=False)
    elif field == "top_p":
        if not 0 < value <= 1:
            raise SamplingRefused(field, "in (0, 1]", invalid=True)
    elif field == "min_p":
        if not 0 <= value <= 1:
            raise SamplingRefused(field, "in [0, 1]", invalid=True)
    elif value != DEFAULTS[field]:  # the three penalties
        raise SamplingRefused(field, PENALTY_REASON, invalid=False)


def check(request: Mapping[str, Any]) -> None:
    """Raise SamplingRefused for the first sampling field of `request` that cannot be captured."""
    for field in FIELDS:
        check_field(field, request.get(field))


def resolved(request: Mapping[str, Any]) -> dict[str, Any]:
    """Every sampling field with its value: the client's where it sent one (unchanged), else the neutral default."""
    out: dict[str, Any] = {}
    for field in FIELDS:
        value = request.get(field)
        out[field] = DEFAULTS[field] if value is None else value
    return out


@dataclass(frozen=True, slots=True)
class Sampling:
    """The effective sampling of one sample, as recorded in its document (`sampling`)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float

    @classmethod
    def of_request(cls, request: Mapping[str, Any]) -> "Sampling":
        """The sampling of a checked request (`check`), defaults filled in."""
        values = resolved(request)
        return cls(
            temperature=float(values["temperature"]), top_p=float(values["top_p"]), top_k=int(values["top_k"]),
            min_p=float(values["min_p"]), presence_penalty=float(values["presence_penalty"]),
            frequency_penalty=float(values["frequency_penalty"]),
            repetition_penalty=float(values["repetition_penalty"]),
        )

    @classmethod
    def of_record(cls, record: Any) -> "Sampling":
        """A sample's recorded sampling; a sample without one (a rail upload, or one captured while the gateway
        pinned the sampling) was drawn at the neutral defaults. Raises ValueError for a record no capture wrote."""
        if record is None:
            return cls.of_request({})
        if not isinstance(record, Mapping):
            raise ValueError("a sample's sampling record must be an object")
        try:
            check(record)
        except SamplingRefused as exc:
            raise ValueError(f"sample sampling record: {exc}") from None
        return cls.of_request(record)

    @property
    def truncates(self) -> bool:
        """Whether tokens outside a nucleus, a top-k or a min-p cut could not be drawn: the behaviour distribution
        is then the policy's renormalized over what is left, and differs from what the trainers compute."""
        return self.top_p < 1.0 or self.top_k >= 1 or self.min_p > 0.0

    def record(self) -> dict[str, Any]:
        return asdict(self)
