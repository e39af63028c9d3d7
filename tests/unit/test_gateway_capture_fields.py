"""The per-field rules of captured requests, the ignored-fields header and the upstream error answer, as plain
functions (the same behaviour over real processes: tests/system/test_gateway_inference_guards.py)."""

from __future__ import annotations

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.gateway import capture_secret
from openjiuwen.agent_evolving.agent_rl.gateway.capture_fields import (
    REFUSED, FieldRefused, ignored_header, screen,
)
from openjiuwen.agent_evolving.agent_rl.gateway.responses import upstream_error

BASE = {"model": "tiny:v1", "messages": [{"role": "user", "content": "hi"}]}
NEUTRAL = {"logit_bias": {}, "allowed_token_ids": None, "bad_words": [], "min_tokens": 0, "ignore_eos": False,
           "response_format": {"type": "text"}, "structured_outputs": None, "tool_choice": "none",
           "parallel_tool_calls": True, "thinking_token_budget": None, "watermarking": False, "logits_processors": [],
           "vllm_xargs": {}, "logprob_token_ids": [], "chat_template": None, "echo": False,
           "add_generation_prompt": True, "continue_final_message": False, "use_beam_search": False, "best_of": 1,
           "length_penalty": 1}


def test_every_refused_field_has_a_neutral_value_that_passes_unchanged() -> None:
    assert set(NEUTRAL) == set(REFUSED)
    out = screen({**BASE, **NEUTRAL})
    assert out.ignored == () and {k: out.request[k] for k in NEUTRAL} == NEUTRAL


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"1": -100}), ("min_tokens", 1), ("min_tokens", True), ("ignore_eos", 1),
    ("response_format", {"type": "text", "extra": 1}), ("tool_choice", "required"), ("parallel_tool_calls", 0),
    ("best_of", 2), ("length_penalty", 0.5), ("guided_grammar", "root ::= 'a'"), ("guided_whatever", 0),
])
def test_a_non_neutral_value_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(FieldRefused) as refused:
        screen({**BASE, field: value})
    assert refused.value.field == field and str(refused.value).startswith(f"{field} is not allowed")


def test_anthropic_names_are_used_in_refusals_and_the_ignored_list() -> None:
    names = {"parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}
    with pytest.raises(FieldRefused, match=r"^tool_choice\.disable_parallel_tool_use is not allowed"):
        screen({**BASE, "parallel_tool_calls": False}, names=names)


def test_sampling_fields_are_honoured_as_sent_and_never_listed_as_ignored() -> None:
    """Issue 29: the client's own sampling reaches vLLM unchanged (the RL Service fills what it left out)."""
    assert screen(BASE).request == BASE and screen(BASE).ignored == ()
    sent = {"temperature": 0.3, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "presence_penalty": 0,
            "frequency_penalty": 0.0, "repetition_penalty": 1}
    out = screen({**BASE, **sent, "seed": 7})
    assert out.request == {**BASE, **sent, "seed": 7} and out.ignored == ()
    assert screen({**BASE, "temperature": None, "top_k": -1}).request == {**BASE, "temperature": None, "top_k": -1}


@pytest.mark.parametrize("field,value,reason", [
    ("temperature", 0, "greedy decoding"), ("temperature", 0.0, "greedy decoding"),
    ("temperature", 0.005, "raises a temperature below 0.01"), ("presence_penalty", 0.5, "without penalties"),
    ("frequency_penalty", -1, "without penalties"), ("repetition_penalty", 1.05, "without penalties"),
])
def test_sampling_the_trainers_cannot_reproduce_is_refused_with_the_reason(field, value, reason) -> None:
    with pytest.raises(FieldRefused) as refused:
        screen({**BASE, field: value})
    assert not refused.value.invalid and refused.value.field == field
    assert str(refused.value).startswith(f"{field} is not allowed in a captured request: ") and reason in str(
        refused.value)


@pytest.mark.parametrize("field,value", [
    ("temperature", 2.5), ("temperature", -0.1), ("temperature", float("nan")), ("temperature", True),
    ("temperature", "0.7"), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("top_k", 20.0), ("top_k", False),
    ("min_p", 1.1), ("min_p", float("inf")), ("presence_penalty", "0"),
])
def test_sampling_values_vllm_would_refuse_are_invalid(field, value) -> None:
    with pytest.raises(FieldRefused) as refused:
        screen({**BASE, field: value})
    assert refused.value.invalid and str(refused.value).startswith(f"{field} must be ")


def test_unknown_and_useless_fields_are_dropped_and_strict_tools_lose_strict() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}
    loose = {"type": "function", "function": {"name": "g", "strict": False}}
    out = screen({**BASE, "metadata": {}, "prompt_logprobs": 1, "tools": [tool, loose], "guided_json": None})
    assert out.ignored == ("metadata", "prompt_logprobs", "tools[0].function.strict")
    assert out.request["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {}}},
                                    {"type": "function", "function": {"name": "g"}}]
    assert not {"metadata", "prompt_logprobs", "guided_json"} & set(out.request)


def test_the_ignored_header_is_printable_and_bounded() -> None:
    value = ignored_header(["a,b", "\r\n", "", "é" * 100] + [f"k{i}" for i in range(40)])
    assert value.isascii() and value.isprintable()
    parts = value.split(", ")
    assert parts[:4] == ["a%2Cb", "%0D%0A", '""', "%C3%A9" * 64] and parts[-1] == "+12 more" and len(parts) == 33


@pytest.mark.parametrize("status,body,declared,expected_status,passed", [
    (404, b'{"error": {"message": "no", "type": "NotFoundError", "param": "model", "code": 404}}', "text/plain",
     404, True),
    (418, b"<script>alert(1)</script>", "text/html", 418, False),
    (500, b'{"error": ', "application/json", 500, False),
    (503, b'"a json string"', "application/json", 503, False),
    (302, b"", None, 502, False),
    (201, b"{}", "application/json", 502, True),
])
def test_upstream_errors_are_json_only(status, body, declared, expected_status, passed) -> None:
    answer = upstream_error(status, body, declared)
    assert answer.status_code == expected_status and answer.media_type == "application/json"
    if passed:
        assert answer.body == body
    else:
        error = orjson.loads(answer.body)["error"]
        assert error["code"] == "upstream_error" and str(status) in error["message"]
        assert body[:10] not in answer.body or not body


def test_capture_secrets_match_only_themselves() -> None:
    secret, digest = capture_secret.mint()
    other, _ = capture_secret.mint()
    assert len(secret) >= 43 and secret != other
    assert capture_secret.matches(secret, digest)
    for wrong in (None, "", other, secret[:-1], secret + "x", secret.upper()):
        assert not capture_secret.matches(wrong, digest)
