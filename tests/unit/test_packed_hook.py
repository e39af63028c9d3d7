"""The packed `:after` body (common/packed_hook.py): what the gateway packs, what the service unpacks, and every
shape that must fall back to JSON or be refused."""

from __future__ import annotations

import copy
import math
import struct
from array import array

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.common.packed_hook import PackedBodyError, pack_after, unpack_after
from openjiuwen.agent_evolving.agent_rl.online.capture.response import logprobs_valid
from openjiuwen.agent_evolving.agent_rl.online.store.codec import pack_ids, unpack_ids
from tests.conftest import load_fixture

RESPONSE = load_fixture("chat_response.json")
HEAD = {"rl_task_id": "rl-0123456789abcdef0123456789abcdef", "capture_id": "c1", "agent_turn_id": None,
        "request": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}


def packed(response=None) -> bytes | None:
    return pack_after(orjson.dumps(HEAD), RESPONSE if response is None else response)


def test_a_recorded_vllm_answer_round_trips():
    head, arrays = unpack_after(packed())
    choice = RESPONSE["choices"][0]
    assert unpack_ids(arrays.prompt_ids) == RESPONSE["prompt_token_ids"]
    assert unpack_ids(arrays.response_ids) == choice["token_ids"]
    assert list(arrays.logprobs) == [e["logprob"] for e in choice["logprobs"]["content"]]  # float64: exact
    assert {k: head[k] for k in HEAD} == HEAD
    assert "prompt_token_ids" not in head["response"]
    assert not {"token_ids", "logprobs"} & set(head["response"]["choices"][0])
    assert head["response"]["choices"][0]["message"] == choice["message"]
    assert head["response"]["usage"] == RESPONSE["usage"]


def test_the_arrays_are_the_stores_own_layout():
    _, arrays = unpack_after(packed())
    assert arrays.prompt_ids == pack_ids(RESPONSE["prompt_token_ids"])
    assert arrays.response_ids == pack_ids(RESPONSE["choices"][0]["token_ids"])
    assert (arrays.prompt_count, arrays.response_count) == (len(RESPONSE["prompt_token_ids"]),
                                                             len(RESPONSE["choices"][0]["token_ids"]))


def _with(change) -> dict:
    response = copy.deepcopy(RESPONSE)
    change(response)
    return response


@pytest.mark.parametrize("change", [
    lambda r: r["choices"][0]["token_ids"].__setitem__(0, True),  # bool: the JSON path refuses it
    lambda r: r["choices"][0]["token_ids"].__setitem__(0, 1.0),
    lambda r: r["choices"][0]["token_ids"].__setitem__(0, -1),
    lambda r: r["prompt_token_ids"].__setitem__(0, 2**32),
    lambda r: r["choices"][0]["logprobs"]["content"][0].__setitem__("logprob", False),
    lambda r: r["choices"][0]["logprobs"]["content"][0].__setitem__("logprob", "-0.5"),
    lambda r: r["choices"][0]["logprobs"]["content"].pop(),  # not aligned with the ids
    lambda r: r["choices"][0].__setitem__("logprobs", None),
    lambda r: r.pop("prompt_token_ids"),
    lambda r: r["choices"].append(r["choices"][0]),
], ids=["bool-id", "float-id", "negative-id", "id-over-uint32", "bool-logprob", "string-logprob", "misaligned",
        "no-logprobs", "no-prompt-ids", "two-choices"])
def test_a_response_the_packed_form_cannot_carry_falls_back_to_json(change):
    assert packed(_with(change)) is None


def test_a_nan_logprob_is_carried_for_the_service_to_refuse():
    body = packed(_with(lambda r: r["choices"][0]["logprobs"]["content"][0].__setitem__("logprob", math.nan)))
    _, arrays = unpack_after(body)
    assert not logprobs_valid(arrays.logprobs)


@pytest.mark.parametrize("cut, message", [
    (lambda b: b[:10], "shorter than its header"),
    (lambda b: b"XXXX" + b[4:], "unknown magic"),
    (lambda b: b[:-1], "length does not match"),
    (lambda b: b + b"\0", "length does not match"),
    (lambda b: struct.pack("<4sIII", b"RLH1", 3, 0, 0) + b"{no", "not valid JSON"),
    (lambda b: struct.pack("<4sIII", b"RLH1", 2, 0, 0) + b"[]", "must be an object"),
    (lambda b: struct.pack("<4sIII", b"RLH1", 2**32 - 1, 2**32 - 1, 2**32 - 1), "length does not match"),
])
def test_a_malformed_packed_body_is_refused(cut, message):
    with pytest.raises(PackedBodyError, match=message):
        unpack_after(cut(packed()))


@pytest.mark.parametrize("values, valid", [
    ([], True),
    ([-0.0, 0.0, -1.5], True),
    ([-1e308, -1e308], True),  # the sum overflows, every value is fine
    ([-0.1, 0.5], False),
    ([-0.1, math.nan], False),
    ([-0.1, -math.inf], False),
    ([math.inf, -math.inf], False),
    ([-1e308, -1e308, 1.0], False),
])
def test_logprob_check(values, valid):
    assert logprobs_valid(array("d", values)) is valid
