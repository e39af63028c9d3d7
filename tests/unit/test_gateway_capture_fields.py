"""The checks of captured requests (issue 35: nothing refused for capture's sake, only what vLLM itself refuses) and
the upstream error answer, as plain functions (the same behaviour over real processes:
tests/system/test_gateway_inference_guards.py)."""

from __future__ import annotations

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.auth import capture_secret
from openjiuwen.agent_evolving.agent_rl.gateway.proxy.capture_fields import FieldInvalid, check_request
from openjiuwen.agent_evolving.agent_rl.gateway.responses import upstream_error

BASE = {"model": "tiny:v1", "messages": [{"role": "user", "content": "hi"}]}
# Every field issue 19 refused inside a Task, with a value that shaped sampling: all served now.
SERVED = {"logit_bias": {"1": -100}, "allowed_token_ids": [5, 6], "bad_words": ["no"], "min_tokens": 2,
          "ignore_eos": True, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "[a-z]+"},
          "tool_choice": "required", "parallel_tool_calls": False, "thinking_token_budget": 8, "watermarking": True,
          "logits_processors": ["x"], "vllm_xargs": {"a": 1}, "chat_template": "{{ 1 }}", "echo": True,
          "add_generation_prompt": False, "continue_final_message": True, "use_beam_search": True, "best_of": 2,
          "length_penalty": 0.5, "guided_grammar": "root ::= 'a'", "temperature": 0, "presence_penalty": 1.5,
          "frequency_penalty": -2, "repetition_penalty": 1.3, "n": 1, "metadata": {"who": "x"}, "prompt_logprobs": 1}


def test_every_field_vllm_serves_passes_the_checks() -> None:
    check_request({**BASE, **SERVED})
    check_request({**BASE, "temperature": 0.005, "n": 4, "top_k": -1})
    check_request({**BASE, "logprobs": True, "top_logprobs": 3, "logprob_token_ids": [5]})


@pytest.mark.parametrize("field,value,message", [
    ("temperature", 2.5, "temperature must be in [0, 2]"), ("temperature", -0.1, "temperature must be in [0, 2]"),
    ("temperature", float("nan"), "temperature must be a finite JSON number"),
    ("temperature", True, "temperature must be a finite JSON number"),
    ("temperature", "0.7", "temperature must be a finite JSON number"), ("top_p", 0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1]"), ("top_k", -2, "top_k must be an integer"),
    ("top_k", 20.0, "top_k must be an integer"), ("top_k", False, "top_k must be an integer"),
    ("min_p", 1.1, "min_p must be in [0, 1]"), ("min_p", float("inf"), "min_p must be a finite JSON number"),
    ("presence_penalty", "0", "presence_penalty must be a finite JSON number"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0, "repetition_penalty must be greater than 0"),
    ("n", 0, "n must be a positive integer"), ("n", True, "n must be a positive integer"),
    ("n", 2.0, "n must be a positive integer"), ("top_logprobs", 2, "top_logprobs must be absent or 0"),
    ("logprob_token_ids", [5], "logprob_token_ids must be absent unless logprobs is true"),
])
def test_values_vllm_would_refuse_are_invalid_naming_the_field(field, value, message) -> None:
    with pytest.raises(FieldInvalid) as refused:
        check_request({**BASE, field: value})
    assert refused.value.field == field and str(refused.value).startswith(message)


def test_several_greedy_choices_are_invalid_as_vllm_refuses_them() -> None:
    with pytest.raises(FieldInvalid, match=r"^n must be 1 under greedy decoding"):
        check_request({**BASE, "temperature": 0, "n": 2})


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
