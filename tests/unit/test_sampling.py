"""The sampling of captured completions (issues 29 and 35, common/sampling.py) and the injected request the RL
Service builds from it (online/capture/request.py): the client's sampling kept, the rest made explicit, the client's
`top_logprobs` honoured, a record per sample of what vLLM really applied."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.common.sampling import DEFAULTS, InvalidSampling, Sampling, check, resolved
from openjiuwen.agent_evolving.agent_rl.online.capture.request import normalize_request, validate_request
from openjiuwen.agent_evolving.agent_rl.online.errors import InvalidInput

REQUEST = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_fields_the_client_left_out_get_vllms_neutral_values_and_sent_ones_stay_as_sent() -> None:
    assert resolved({}) == DEFAULTS == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                        "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                        "repetition_penalty": 1.0}
    assert resolved({"temperature": 0.7, "top_k": -1, "top_p": None}) == {**DEFAULTS, "temperature": 0.7, "top_k": -1}


def test_the_record_is_the_effective_sampling_and_says_whether_it_truncates() -> None:
    record = Sampling.of_request({"temperature": 1, "top_p": 0.9}).record()
    assert record == {**DEFAULTS, "temperature": 1.0, "top_p": 0.9}
    assert type(record["temperature"]) is float and type(record["top_k"]) is int
    assert Sampling.of_record(record) == Sampling.of_request({"temperature": 1, "top_p": 0.9})
    assert [Sampling.of_request(r).truncates for r in ({}, {"temperature": 0.3}, {"top_p": 0.95}, {"top_k": 1},
                                                        {"top_k": -1}, {"min_p": 0.1})] == [
        False, False, True, True, False, True]


def test_a_sample_without_a_record_was_drawn_at_the_neutral_defaults_and_a_bad_record_is_an_error() -> None:
    assert Sampling.of_record(None) == Sampling.of_request({})
    for bad in ("hot", {"temperature": -1}, {"temperature": "1"}, {"repetition_penalty": 0}):
        with pytest.raises(ValueError):
            Sampling.of_record(bad)


def test_the_record_is_what_vllm_applied_greedy_and_raised_temperatures_included() -> None:
    """Issue 35: vLLM raises a temperature in (0, 0.01) to 0.01, and under greedy decoding (temperature 0) it drops
    top_p, top_k and min_p; penalties are recorded as sent."""
    greedy = Sampling.of_request({"temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.2, "presence_penalty": 1})
    assert greedy.record() == {**DEFAULTS, "temperature": 0.0, "presence_penalty": 1.0}
    assert greedy.greedy and greedy.penalized and not greedy.truncates and greedy.train_temperature == 1.0
    low = Sampling.of_request({"temperature": 0.004})
    assert low.temperature == 0.01 and not low.greedy and low.train_temperature == 0.01
    assert Sampling.of_record({**greedy.record(), "constraints": {"greedy": {}}}) == greedy


def test_check_names_the_first_field_vllm_would_refuse() -> None:
    check({**REQUEST, "temperature": 0, "top_p": 1, "min_p": 0, "top_k": 0, "repetition_penalty": 2,
           "presence_penalty": -2, "frequency_penalty": 2})
    with pytest.raises(InvalidSampling) as refused:
        check({"top_p": 0.5, "temperature": 2.1, "repetition_penalty": 0})
    assert refused.value.field == "temperature" and str(refused.value) == "temperature must be in [0, 2]"


def test_the_injected_request_names_every_sampling_field_and_is_idempotent() -> None:
    request = {**REQUEST, "temperature": 0.7, "top_p": 0.9, "stream": True}
    injected = normalize_request(request)
    assert {k: injected[k] for k in DEFAULTS} == {**DEFAULTS, "temperature": 0.7, "top_p": 0.9}
    assert (injected["logprobs"], injected["top_logprobs"], injected["return_token_ids"]) == (True, 0, True)
    assert normalize_request(injected) == injected
    assert request == {**REQUEST, "temperature": 0.7, "top_p": 0.9, "stream": True}  # the caller's copy untouched


@pytest.mark.parametrize("asked,expected", [
    ({"logprobs": True, "top_logprobs": 3}, 3),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": None}, 0),
    ({"logprobs": False, "top_logprobs": 3}, 0),  # the client sees no logprobs: alternatives would be wasted
    ({"top_logprobs": 5}, 0),
])
def test_the_clients_top_logprobs_are_honoured_when_it_asked_for_logprobs(asked, expected) -> None:
    injected = normalize_request({**REQUEST, **asked})
    assert injected["top_logprobs"] == expected and injected["logprobs"] is True
    assert normalize_request(injected) == injected


@pytest.mark.parametrize("extra,message", [
    ({"temperature": 3}, "request.temperature must be in [0, 2]"),
    ({"presence_penalty": 2.2}, "request.presence_penalty must be in [-2, 2]"),
    ({"n": 0}, "request.n must be absent or a positive integer"),
    ({"n": 2, "temperature": 0}, "request.n must be 1 under greedy decoding"),
    ({"top_logprobs": "3"}, "request.top_logprobs must be absent, null or an integer of at least -1"),
    ({"top_logprobs": True}, "request.top_logprobs must be"),
    ({"top_logprobs": -2}, "request.top_logprobs must be"),
])
def test_the_rl_service_refuses_what_vllm_would_refuse_at_before(extra, message) -> None:
    with pytest.raises(InvalidInput) as refused:
        validate_request({**REQUEST, **extra}, policy_model="tiny", delayed=False, agent_turn_id=None)
    assert refused.value.code == "invalid_completion" and str(refused.value).startswith(message)


@pytest.mark.parametrize("extra", [{"temperature": 0}, {"temperature": 0.001}, {"repetition_penalty": 1.3},
                                   {"n": 3}, {"logit_bias": {"5": 10}}, {"response_format": {"type": "json_object"}}])
def test_the_rl_service_accepts_greedy_decoding_penalties_and_several_choices(extra) -> None:
    """Issue 35: `:before` refused these with 400 invalid_completion (an AIGW saw that too); now they are captured
    and their constraints recorded."""
    validate_request({**REQUEST, **extra}, policy_model="tiny", delayed=False, agent_turn_id=None)
