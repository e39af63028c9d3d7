"""The JSON nesting bound (common/json_nesting.py): exact at the bound, whatever the containers, whatever the text."""

from __future__ import annotations

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.common import json_nesting
from openjiuwen.agent_evolving.agent_rl.common.json_nesting import MAX_DEPTH, TooDeep, loads, nesting_exceeds


def lists(depth: int, leaf: bytes = b"1") -> bytes:
    return b"[" * depth + leaf + b"]" * depth


def objects(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize("build", [lists, objects])
def test_the_bound_is_exact(build) -> None:
    assert loads(build(MAX_DEPTH)) is not None
    with pytest.raises(TooDeep, match=f"JSON nested deeper than {MAX_DEPTH} levels"):
        loads(build(MAX_DEPTH + 1))


def test_depth_counts_containers_only() -> None:
    assert not nesting_exceeds(1, 0) and not nesting_exceeds("x", 0)
    assert nesting_exceeds([], 0) and not nesting_exceeds([], 1)
    assert nesting_exceeds({"a": [1]}, 1) and not nesting_exceeds({"a": [1]}, 2)


def test_the_deepest_branch_counts_among_wide_shallow_ones() -> None:
    wide = {"ids": list(range(10_000)), "entries": [{"t": "x", "lp": -0.5}] * 2_000}
    assert not nesting_exceeds(wide, 3)
    wide["entries"] = [*wide["entries"], {"deep": orjson.loads(lists(10))}]
    assert nesting_exceeds(wide, 12) and not nesting_exceeds(wide, 13)


def test_brackets_inside_strings_never_hide_or_fake_depth() -> None:
    text = b'{"s": "' + b"[" * 500 + b'", "v": ' + lists(MAX_DEPTH) + b"}"
    with pytest.raises(TooDeep):
        loads(text)  # more openers than the bound in the text: walked, and the value is really 129 deep
    assert loads(b'{"s": "' + b"[" * 500 + b'"}') == {"s": "[" * 500}


def test_past_orjsons_own_reader_bound_the_same_refusal() -> None:
    with pytest.raises(TooDeep):
        loads(lists(5_000))


def test_a_too_deep_document_is_malformed_json_to_every_reader() -> None:
    """Readers that only know `orjson.JSONDecodeError` refuse it as invalid JSON; none lets it through as a 500."""
    with pytest.raises(orjson.JSONDecodeError):
        loads(lists(MAX_DEPTH + 1))
    assert isinstance(TooDeep(3), ValueError) and str(TooDeep(3)) == "JSON nested deeper than 3 levels"


def test_a_custom_bound_and_text_as_str() -> None:
    assert json_nesting.loads("[[1]]", max_depth=2) == [[1]]
    with pytest.raises(TooDeep):
        json_nesting.loads("[[[1]]]", max_depth=2)
