"""What a sample records of the fields that constrained its sampling (issue 35, common/constraints.py): one entry
per kind, bounded details, in a fixed order; and which kinds the training policy keeps out."""

from __future__ import annotations

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.common import constraints
from openjiuwen.agent_evolving.agent_rl.common.constraints import KINDS, excluded_kinds, kinds_of, of_request

BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "top_p": 1.0,
        "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
TOOLS = [{"type": "function", "function": {"name": "a", "parameters": {}}},
         {"type": "function", "function": {"name": "b", "parameters": {}, "strict": True}}]


def test_an_unconstrained_request_records_nothing() -> None:
    assert of_request(BASE) == {}
    neutral = {"logit_bias": {}, "bad_words": [], "min_tokens": 0, "ignore_eos": False, "tool_choice": "auto",
               "response_format": {"type": "text"}, "echo": False, "add_generation_prompt": True, "best_of": 1,
               "use_beam_search": False, "structured_outputs": None, "guided_json": None, "n": 3}
    assert of_request({**BASE, **neutral}) == {}


@pytest.mark.parametrize("extra,expected", [
    ({"temperature": 0}, {"greedy": {}}),
    ({"repetition_penalty": 1.2, "presence_penalty": 0.0}, {"penalties": {"repetition_penalty": 1.2}}),
    ({"logit_bias": {"1": -100, "2": 3.5}}, {"logit_bias": {"count": 2, "min": -100, "max": 3.5}}),
    ({"allowed_token_ids": [1, 2, 3]}, {"allowed_tokens": {"count": 3}}),
    ({"bad_words": ["x", "y"]}, {"banned_tokens": {"count": 2}}),
    ({"min_tokens": 4}, {"min_tokens": {"value": 4}}),
    ({"ignore_eos": True}, {"ignore_eos": {}}),
    ({"thinking_token_budget": 64}, {"thinking_budget": {"value": 64}}),
    ({"logits_processors": ["p"], "vllm_xargs": {"a": 1, "b": 2}}, {"logits_processors": {"count": 3}}),
    ({"watermarking": True}, {"watermarking": {}}),
    ({"response_format": {"type": "json_object"}}, {"json_object": {"source": "response_format"}}),
    ({"structured_outputs": {"choice": ["a", "b", "c"]}}, {"choice": {"source": "structured_outputs", "count": 3}}),
    ({"guided_choice": ["a"]}, {"choice": {"source": "guided_choice", "count": 1}}),
    ({"tools": TOOLS, "tool_choice": "required"}, {"tool_required": {"tools": 2}, "strict_tools": {"count": 1}}),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "b" * 100}}},
     {"tool_named": {"name": "b" * 64}, "strict_tools": {"count": 1}}),
    ({"tools": TOOLS, "parallel_tool_calls": False}, {"strict_tools": {"count": 1}, "single_tool_call": {}}),
    ({"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": False}, {}),  # no call can be made
    ({"echo": True, "continue_final_message": True, "add_generation_prompt": False},
     {"echo": {}, "continue_final_message": {}, "no_generation_prompt": {}}),
    ({"use_beam_search": True, "n": 4}, {"beam_search": {"beam_width": 4}}),
    ({"best_of": 3}, {"beam_search": {"best_of": 3}}),
])
def test_each_field_is_recorded_under_its_kind(extra, expected) -> None:
    assert of_request({**BASE, **extra}) == expected


def test_schemas_patterns_and_templates_are_recorded_as_digest_and_size_never_themselves() -> None:
    schema = {"type": "object", "properties": {"secret_field": {"type": "string"}}}
    recorded = of_request({**BASE, "response_format": {"type": "json_schema", "json_schema": {
        "name": "Out", "schema": schema, "strict": True}}, "chat_template": "{{ 'hidden prompt' }}",
        "guided_regex": "[a-z]+", "structured_outputs": {"grammar": "root ::= 'x'", "json": schema}})
    assert list(recorded) == ["json_schema", "regex", "grammar", "chat_template"]  # KINDS order
    raw = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    assert recorded["json_schema"] == {"source": "response_format", "name": "Out",
                                       "digest": constraints._digest(schema)["digest"], "bytes": len(raw),
                                       "strict": True}  # response_format named it first
    assert recorded["regex"]["source"] == "guided_regex" and recorded["regex"]["bytes"] == 6
    text = orjson.dumps(recorded).decode()
    assert "secret_field" not in text and "hidden prompt" not in text and "root ::=" not in text
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    assert len(orjson.dumps(of_request({**BASE, "guided_json": huge}))) < 200  # bounded whatever the schema


def test_kinds_of_a_record_and_the_policy() -> None:
    assert kinds_of(None) == () and kinds_of({"temperature": 1.0}) == ()  # rail samples, pre-issue-35 samples
    assert kinds_of({"constraints": {"greedy": {}, "json_schema": {}, "unknown": {}}}) == ("json_schema", "greedy")
    defaults = constraints.POLICY_DEFAULTS
    assert excluded_kinds(("json_schema", "greedy", "echo"), defaults) == ("greedy", "echo")
    assert excluded_kinds(("json_schema", "greedy"), {**defaults, "grammar": "exclude", "greedy": "correct"}) == (
        "json_schema",)
    assert excluded_kinds(("beam_search",), {**defaults, "beam_search": "correct"}) == ("beam_search",)  # never
    assert set(KINDS) >= {"json_schema", "tool_required", "tool_named", "strict_tools", "greedy", "penalties",
                          "logit_bias", "banned_tokens", "min_tokens"}
