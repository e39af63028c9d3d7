"""PackedSample: packed arrays round-trip exactly (ids) or to float32 (logprobs), staged framing included."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from openjiuwen.agent_evolving.agent_rl.online.store.codec import (
    _HEADER,
    PackedSample,
    decode_meta,
    encode_meta,
    pack_ids,
    pack_logprobs,
    unpack_ids,
    unpack_logprobs,
)

MAX_ID = 2**32 - 1


def _float32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _doc(prompt: list[int], response: list[int], logprobs: list[float]) -> dict:
    return {
        "sample_id": "c1",
        "request": {"messages": [{"role": "user", "content": "héllo"}]},
        "trajectory": {
            "prompt_ids": prompt,
            "response_ids": response,
            "response_logprobs": logprobs,
            "response_text": "hi",
            "response_mask": [1, 0],
        },
    }


def test_empty_arrays_round_trip() -> None:
    packed = PackedSample.from_document(_doc([], [], []))
    assert (packed.prompt_ids, packed.response_ids, packed.response_logprobs) == (b"", b"", b"")
    assert len(packed.prompt_ids) + len(packed.response_ids) == 0
    doc = packed.to_document()
    assert doc["trajectory"]["prompt_ids"] == []
    assert doc["trajectory"]["response_ids"] == []
    assert doc["trajectory"]["response_logprobs"] == []


def test_document_without_trajectory_gets_empty_arrays() -> None:
    packed = PackedSample.from_document({"sample_id": "x"})
    assert packed.to_document()["trajectory"] == {
        "prompt_ids": [], "response_ids": [], "response_logprobs": [], "response_text": "",
    }


def test_response_text_is_stored_only_when_it_differs_from_the_content() -> None:
    response = {"choices": [{"message": {"role": "assistant", "content": "hello", "reasoning": "think"}}]}
    same = PackedSample.from_document({"response": response, "trajectory": {"response_text": "hello"}})
    assert "response_text" not in same.meta["trajectory"]
    assert same.to_document()["trajectory"]["response_text"] == "hello"
    other = PackedSample.from_document({"response": response, "trajectory": {"response_text": "edited"}})
    assert other.meta["trajectory"]["response_text"] == "edited"
    assert other.to_document()["trajectory"]["response_text"] == "edited"
    reasoning_only = {"choices": [{"message": {"content": None, "reasoning": "think"}}]}
    assert PackedSample.from_document({"response": reasoning_only}).to_document()["trajectory"]["response_text"] == "think"


def test_ids_are_uint32_little_endian_up_to_the_max() -> None:
    ids = [0, 1, 255, 256, 65535, 2**31, MAX_ID]
    data = pack_ids(ids)
    assert data == b"".join(struct.pack("<I", i) for i in ids)
    assert unpack_ids(data) == ids


def test_ids_outside_uint32_are_refused() -> None:
    with pytest.raises(OverflowError):
        pack_ids([MAX_ID + 1])
    with pytest.raises(OverflowError):
        pack_ids([-1])


def test_logprobs_are_float32_little_endian() -> None:
    values = [0.0, -0.1, -1e-8, -12.345678901234, -1e30]
    data = pack_logprobs(values)
    assert data == b"".join(struct.pack("<f", v) for v in values)
    assert unpack_logprobs(data) == [_float32(v) for v in values]
    assert unpack_logprobs(data)[1] != -0.1  # rounded to float32, by design


def test_to_document_keeps_everything_but_packs_only_the_three_arrays() -> None:
    doc = _doc([1, 2, 3], [4, 5], [-0.5, -0.25])
    packed = PackedSample.from_document(doc)
    assert "prompt_ids" not in packed.meta["trajectory"]
    assert packed.meta["trajectory"]["response_mask"] == [1, 0]  # not one of the packed arrays
    assert packed.to_document() == doc  # -0.5 and -0.25 are exact in float32
    assert doc["trajectory"]["prompt_ids"] == [1, 2, 3]  # the input document is not mutated
    assert (len(packed.prompt_ids), len(packed.response_ids)) == (3 * 4, 2 * 4)  # 4 bytes a token id


def test_meta_json_is_the_document_without_arrays() -> None:
    import orjson

    packed = PackedSample.from_document(_doc([7], [8], [-1.0]))
    meta = orjson.loads(packed.meta_json())
    assert meta["request"]["messages"][0]["content"] == "héllo"
    assert set(meta["trajectory"]) == {"response_text", "response_mask"}


def test_staged_encoding_round_trips() -> None:
    packed = PackedSample.from_document(_doc([1, MAX_ID, 3], [9, 8, 7, 6], [-0.1, -0.2, -0.3, -0.4]))
    blob = packed.encode_staged()
    assert blob[:4] == b"RLS2"
    back = PackedSample.decode_staged(blob)
    assert back == packed
    assert back.to_document() == packed.to_document()


def test_staged_values_of_the_first_format_still_decode() -> None:
    # RLS1: the meta as plain JSON, as written before compression existed (staged samples may outlive an upgrade).
    import orjson

    packed = PackedSample.from_document(_doc([1, 2], [3], [-0.5]))
    body = orjson.dumps(packed.meta)
    old = b"".join((_HEADER.pack(b"RLS1", len(body), 8, 4, 4), body, packed.prompt_ids, packed.response_ids,
                    packed.response_logprobs))
    assert PackedSample.decode_staged(old) == packed


def test_large_meta_is_compressed_and_round_trips() -> None:
    import orjson

    doc = _doc([1], [2], [-1.0])
    doc["request"]["messages"].append({"role": "user", "content": "the same few words again " * 400})
    meta = PackedSample.from_document(doc).meta
    blob = encode_meta(meta)
    assert blob[:1] == b"Z" and len(blob) < len(orjson.dumps(meta)) / 4
    assert decode_meta(blob) == meta


def test_small_meta_stays_plain_json_and_plain_json_still_decodes() -> None:
    import orjson

    small = {"sample_id": "c1", "judge": None}
    assert encode_meta(small) == orjson.dumps(small)
    noise = {"sample_id": "c1", "blob": os.urandom(600).hex()}
    assert decode_meta(encode_meta(noise)) == noise
    assert decode_meta(orjson.dumps(noise)) == noise  # a hash written before compression existed
    assert decode_meta(None) == {} and decode_meta(b"") == {}


def test_staged_decoding_refuses_foreign_bytes() -> None:
    blob = PackedSample.from_document(_doc([1], [2], [-1.0])).encode_staged()
    with pytest.raises(ValueError):
        PackedSample.decode_staged(b"XXXX" + blob[4:])


@given(
    prompt=st.lists(st.integers(0, MAX_ID), max_size=64),
    response=st.lists(st.integers(0, MAX_ID), max_size=64),
    logprobs=st.lists(st.floats(-1e6, 0.0, allow_nan=False, width=32), max_size=64),
)
def test_round_trip_property(prompt: list[int], response: list[int], logprobs: list[float]) -> None:
    packed = PackedSample.from_document(_doc(prompt, response, logprobs))
    for restored in (packed.to_document(), PackedSample.decode_staged(packed.encode_staged()).to_document()):
        trajectory = restored["trajectory"]
        assert trajectory["prompt_ids"] == prompt
        assert trajectory["response_ids"] == response
        assert trajectory["response_logprobs"] == logprobs  # float32-representable values are exact
