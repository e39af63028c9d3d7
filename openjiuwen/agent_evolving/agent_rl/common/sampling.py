"""The sampling of a captured completion (issues 29 and 35): the client's own sampling fields, the values vLLM itself
would refuse, and the effective sampling recorded in each sample. Used by the gateway (the checks inside a Task), the
RL Service (the injected request and the sample's `sampling` record) and the trainers (the temperature each row is
trained at).

Inside a Task every value vLLM serves is served as sent; only a value vLLM would refuse is refused (with vLLM 0.32's
ranges). The record is the sampling vLLM really applied (`SamplingParams.__post_init__`): a temperature in
(0, 0.01) is raised to 0.01, and temperature 0 is greedy decoding, under which vLLM ignores `top_p`, `top_k` and
`min_p`. A sample is trained as drawn from the policy at its temperature: the trainers compute log softmax(logits / T)
over the whole vocabulary, row by row; truncation, penalties, grammars and the other constraints (common/constraints.py)
are corrected by importance sampling against the captured processed logprobs, or the sample is kept out of training
(docs/training.md).
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
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
MIN_TEMPERATURE = 0.01  # vLLM raises any temperature in (0, 0.01) to 0.01 (SamplingParams.__post_init__)
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2]


class InvalidSampling(ValueError):
    """A sampling value vLLM itself would refuse (a client mistake, inside a Task or not)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} must be {reason}")
        self.field = field
        self.reason = reason


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def check_field(field: str, value: Any) -> None:
    """Raise InvalidSampling when vLLM would refuse `value` (None = not sent) for the sampling `field`."""
    if value is None:
        return
    if field == "top_k":
        if type(value) is not int or value < -1:
            raise InvalidSampling(field, "an integer, -1 or 0 (no limit) or at least 1")
        return
    if not _number(value):
        raise InvalidSampling(field, "a finite JSON number")
    if field == "temperature":
        if not 0 <= value <= MAX_TEMPERATURE:
            raise InvalidSampling(field, "in [0, 2]")
    elif field == "top_p":
        if not 0 < value <= 1:
            raise InvalidSampling(field, "in (0, 1]")
    elif field == "min_p":
        if not 0 <= value <= 1:
            raise InvalidSampling(field, "in [0, 1]")
    elif field == "repetition_penalty":
        if value <= 0:
            raise InvalidSampling(field, "greater than 0")
    elif not -MAX_PENALTY <= value <= MAX_PENALTY:  # presence and frequency penalties
        raise InvalidSampling(field, "in [-2, 2]")


def check(request: Mapping[str, Any]) -> None:
    """Raise InvalidSampling for the first sampling field of `request` vLLM would refuse."""
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
        """The sampling vLLM applies to a checked request (`check`): defaults filled in, a temperature below 0.01
        raised to 0.01, and under greedy decoding (temperature 0) no truncation, as vLLM resets it."""
        values = resolved(request)
        temperature = float(values["temperature"])
        if temperature == 0:
            return cls(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                       presence_penalty=float(values["presence_penalty"]),
                       frequency_penalty=float(values["frequency_penalty"]),
                       repetition_penalty=float(values["repetition_penalty"]))
        return cls(
            temperature=max(temperature, MIN_TEMPERATURE), top_p=float(values["top_p"]), top_k=int(values["top_k"]),
            min_p=float(values["min_p"]), presence_penalty=float(values["presence_penalty"]),
            frequency_penalty=float(values["frequency_penalty"]),
            repetition_penalty=float(values["repetition_penalty"]),
        )

    @classmethod
    def of_record(cls, record: Any) -> "Sampling":
        """A sample's recorded sampling; a sample without one (a rail upload, or one captured while the gateway
        pinned the sampling) was drawn at the neutral defaults. Raises ValueError for a record no capture wrote.
        The record's `constraints` (common/constraints.py) are not part of it."""
        if record is None:
            return cls.of_request({})
        if not isinstance(record, Mapping):
            raise ValueError("a sample's sampling record must be an object")
        try:
            check(record)
        except InvalidSampling as exc:
            raise ValueError(f"sample sampling record: {exc}") from None
        return cls.of_request(record)

    @property
    def greedy(self) -> bool:
        """Greedy decoding: every token is the argmax, the behaviour distribution a point mass."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return any(getattr(self, name) != DEFAULTS[name] for name in PENALTIES)

    @property
    def train_temperature(self) -> float:
        """The temperature the trainers compute the policy at: the sample's own, 1 for greedy decoding (the policy
        itself; its behaviour probability is 1 for every chosen token, batch.py)."""
        return 1.0 if self.greedy else self.temperature

    @property
    def truncates(self) -> bool:
        """Whether tokens outside a nucleus, a top-k or a min-p cut could not be drawn: the behaviour distribution
        is then the policy's renormalized over what is left, and differs from what the trainers compute."""
        return self.top_p < 1.0 or self.top_k >= 1 or self.min_p > 0.0

    def record(self) -> dict[str, Any]:
        return asdict(self)
