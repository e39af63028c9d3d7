"""The C-speed fast paths of `:after` response validation give exactly the per-element loop's outcome: the same
list, or the same error, for valid and every kind of invalid token id and logprob."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from openjiuwen.agent_evolving.agent_rl.online.capture import response as R
from openjiuwen.agent_evolving.agent_rl.online.errors import InvalidInput, invalid_completion
from openjiuwen.agent_evolving.agent_rl.online.store.codec import MAX_TOKEN_ID, unpack_ids


def _reference_logprobs(value: Any, expected: int) -> list[float]:
    """The loop as it stood before the fast path (the contract's rule, element by element)."""
    if not isinstance(value, dict) or not isinstance(value.get("content"), list):
        raise invalid_completion("choices[0].logprobs.content must be a list")
    out = []
    for entry in value["content"]:
        lp = entry.get("logprob") if isinstance(entry, dict) else None
        if type(lp) is int:
            lp = float(lp)
        if type(lp) is not float or not math.isfinite(lp) or lp > 0:
            raise invalid_completion("every logprob must be a finite number <= 0")
        out.append(lp)
    if len(out) != expected:
        raise invalid_completion("logprobs are not aligned with the completion token ids")
    return out


def _reference_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise invalid_completion(f"{name} must be a non-empty list of non-negative integers")
    for x in value:
        if type(x) is not int or not 0 <= x <= MAX_TOKEN_ID:
            raise invalid_completion(f"{name} must be a non-empty list of integers in 0..{MAX_TOKEN_ID}")
    return value


def _packed_ids(value: Any, name: str) -> list[int]:
    """`_packed_token_ids` read back: the ids it stored."""
    return unpack_ids(R._packed_token_ids(value, name))


def _outcome(fn, *args):
    try:
        result = fn(*args)
    except InvalidInput as exc:
        return ("error", exc.code, exc.message)
    return ("ok", [(type(x), x) for x in result])


_LOGPROB = st.one_of(
    st.floats(max_value=0.0),  # valid, -inf included
    st.floats(allow_nan=True, allow_infinity=True),
    st.just(-1.7e308), st.just(0.0), st.just(-0.0), st.just(1e-300),
    st.integers(-5, 2), st.booleans(), st.none(), st.text(max_size=2),
)
_ENTRY = st.one_of(
    st.fixed_dictionaries({"logprob": _LOGPROB}, optional={"token": st.text(max_size=2)}),
    st.just({}), st.none(), st.integers(), st.lists(st.integers(), max_size=2), st.text(max_size=2),
)


@settings(max_examples=600, deadline=None)
@given(entries=st.lists(_ENTRY, max_size=12), delta=st.integers(-1, 1))
def test_logprobs_same_outcome_as_the_loop(entries: list[Any], delta: int) -> None:
    value = {"content": entries}
    expected = max(0, len(entries) + delta)
    assert _outcome(R._logprobs, value, expected) == _outcome(_reference_logprobs, value, expected)


@settings(max_examples=300, deadline=None)
@given(lps=st.lists(st.floats(max_value=0.0, allow_infinity=False), min_size=1, max_size=20))
def test_valid_logprobs_come_back_unchanged(lps: list[float]) -> None:
    value = {"content": [{"logprob": x, "token": "t"} for x in lps]}
    assert R._logprobs(value, len(lps)) == lps


def test_logprobs_whose_sum_overflows_are_still_valid() -> None:
    lps = [-1.7e308] * 4  # each finite and <= 0; their sum is -inf
    assert R._logprobs({"content": [{"logprob": x} for x in lps]}, 4) == lps


def test_nan_anywhere_is_refused() -> None:
    for i in range(3):
        lps: list[float] = [-1.0, -2.0, -3.0]
        lps[i] = math.nan
        assert _outcome(R._logprobs, {"content": [{"logprob": x} for x in lps]}, 3)[:2] == (
            "error", "invalid_completion")


_ID = st.one_of(st.integers(0, MAX_TOKEN_ID), st.integers(-3, MAX_TOKEN_ID + 3), st.booleans(), st.floats(0, 10),
                st.none(), st.just(MAX_TOKEN_ID), st.just(MAX_TOKEN_ID + 1), st.just(-1))


@settings(max_examples=600, deadline=None)
@given(ids=st.one_of(st.lists(_ID, max_size=12), st.none(), st.just({})))
def test_token_ids_same_outcome_as_the_loop(ids: Any) -> None:
    assert _outcome(_packed_ids, ids, "x") == _outcome(_reference_ids, ids, "x")
