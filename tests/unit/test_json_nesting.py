"""The JSON nesting bound (common/json_nesting.py): exact at the bound, whatever the containers, whatever the text."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openjiuwen.agent_evolving.agent_rl.common import json_nesting
from openjiuwen.agent_evolving.agent_rl.common.json_nesting import (
    MAX_DEPTH, TooDeep, loads, nesting_exceeds, text_exceeds,
)


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


# ------------------------------------------------------------------ the text scan agrees with the walk (issue 38)
# `loads` checks the text it parsed (`text_exceeds`) instead of walking the value (`nesting_exceeds`); the two must
# answer alike on every document, above all where strings hold brackets, quotes and backslashes.

# Characters that could confuse a scan of the text: brackets, quotes, backslashes (escaped alone, in runs, before a
# quote), and a few that JSON writes as escapes or as multi-byte UTF-8.
TRICKY = st.text(alphabet=st.sampled_from(list('[]{}"\\\\/x \n\t\u00e9\u4e2d\U0001f600')), max_size=12)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False, allow_infinity=False), TRICKY)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TRICKY, inner, max_size=4)),
    max_leaves=40,
)


def depth_of(value) -> int:
    """The reference depth, recursively (small values only)."""
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    return 0


def texts_of(value) -> list[bytes | str]:
    """The same document written several ways: orjson's bytes, the stdlib's ASCII escapes, indented, as str."""
    return [orjson.dumps(value), json.dumps(value).encode(), json.dumps(value, ensure_ascii=False, indent=1),
            json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()]


def around_its_depth(value):
    """(text, bound, depth) for each way of writing `value` and each bound just below, at and above its depth."""
    depth = depth_of(value)
    for text in texts_of(value):
        for bound in {max(0, depth - 1), depth, depth + 1}:
            yield text, bound, depth


@settings(max_examples=400, deadline=None)
@given(JSON_VALUES)
def test_the_text_scan_agrees_with_the_walk(value) -> None:
    for text, bound, depth in around_its_depth(value):
        assert text_exceeds(text, bound) is (depth > bound) is nesting_exceeds(value, bound), (text, bound)


@settings(max_examples=200, deadline=None)
@given(st.lists(TRICKY, min_size=1, max_size=6), st.integers(min_value=0, max_value=6),
       st.integers(min_value=0, max_value=3))
def test_strings_around_a_chain_never_move_the_bound(strings, chain, slack) -> None:
    """A chain `chain` deep between strings made of brackets, quotes and backslashes: the text's own bracket count
    is far above the depth, and only the chain counts."""
    value: object = "leaf"
    for _ in range(chain):
        value = [strings[0], value, *strings[1:]]
    document = {s: s for s in strings} | {"chain": value}
    for text in texts_of(document):
        assert text_exceeds(text, chain + 1 + slack) is False
        assert text_exceeds(text, chain) is True


@pytest.mark.parametrize("escaped", ['\\', '\\"', '\\\\"', '"', '\\\\', '\\u005b', '["', '"]'])
def test_escapes_at_the_edge_of_a_string(escaped) -> None:
    """A string ending in an escaped backslash closes there; an escaped quote does not close it."""
    for inner in ([escaped], {escaped: [escaped]}, [escaped + "[", "]" + escaped]):
        text = json.dumps([inner, inner])
        assert text_exceeds(text, depth_of([inner])) is False and text_exceeds(text, depth_of([inner]) - 1) is True


def test_written_escapes_the_encoders_never_use() -> None:
    """`\\u005b` is `[`, `\\/` is `/`: neither is a bracket of the text, however it was written."""
    text = b'{"a\\u005b\\u005b":["\\/[\\"", "\\u0022[["], "b": [[["\\\\"]]]}'
    assert orjson.loads(text) == {"a[[": ['/["', '"[['], "b": [[["\\"]]]}
    assert text_exceeds(text, 4) is False and text_exceeds(text, 3) is True


def test_a_wide_logprobs_body_is_scanned_not_walked() -> None:
    """The shape that made the walk slow (issue 38): thousands of containers, 8 levels."""
    entries = [{"token": "[x", "logprob": -0.5, "bytes": [91, 120], "top_logprobs": []} for _ in range(3_000)]
    body = orjson.dumps({"response": {"choices": [{"logprobs": {"content": entries}}]}})
    assert text_exceeds(body, 8) is False and text_exceeds(body, 7) is True
    assert not nesting_exceeds(orjson.loads(body), 8) and nesting_exceeds(orjson.loads(body), 7)
    assert loads(body, max_depth=8) is not None


# ------------------------------------------------------------- the wrapped parse of long documents (issue 38)
# `loads` parses a long document inside wrapper lists that leave orjson's reader exactly the bound: the same answers
# as parsing it alone and walking it, for valid documents and for every kind of invalid one.

def test_the_pinned_orjson_reads_1024_levels_so_long_documents_are_parsed_wrapped() -> None:
    assert json_nesting._READER_DEPTH == 1024


def padded(core: bytes) -> bytes:
    """`core` beside enough shallow bulk to take the wrapped path."""
    bulk = b"[" + b",".join([b'{"t":"[x","b":[1,2]}'] * 4_000) + b"]"
    assert len(bulk) > json_nesting._WRAP_FROM
    return b'{"bulk":' + bulk + b',"core":' + core + b"}"


@pytest.mark.parametrize("build", [lists, objects])
def test_the_bound_is_exact_in_a_long_document(build) -> None:
    assert loads(padded(build(MAX_DEPTH - 1)))["core"] is not None  # 1 level for the outer object
    with pytest.raises(TooDeep, match=f"JSON nested deeper than {MAX_DEPTH} levels"):
        loads(padded(build(MAX_DEPTH)))
    assert loads(padded(build(MAX_DEPTH)).decode(), max_depth=MAX_DEPTH + 1)["core"] is not None  # str, other bound


def outcome(parse, text, bound):
    try:
        return ("ok", parse(text, bound))
    except TooDeep:
        return ("too deep",)
    except orjson.JSONDecodeError:
        return ("invalid",)


def alone(text, bound):
    """The reference: orjson alone, then the walk."""
    value = orjson.loads(text)
    if nesting_exceeds(value, bound):
        raise TooDeep(bound)
    return value


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_the_wrapped_parse_agrees_with_parsing_alone(value) -> None:
    for text, bound, _ in around_its_depth(value):
        assert outcome(json_nesting._loads_wrapped, text, bound) == outcome(alone, text, bound), (text, bound)


def agrees(text, bound) -> bool:
    """The wrapped parse answers as parsing alone does, except that a text both invalid and deeper than the bound
    may be refused as too deep (the reader meets the depth before the syntax error): refused either way."""
    wrapped, reference = outcome(json_nesting._loads_wrapped, text, bound), outcome(alone, text, bound)
    if wrapped == reference:
        return True
    opens = text.count("[") + text.count("{") if isinstance(text, str) else text.count(b"[") + text.count(b"{")
    return reference == ("invalid",) and wrapped == ("too deep",) and opens > bound


# Texts that are not one JSON value, many of them valid once put between brackets: they must not pass as the wrapped
# parse's single element.
BREAKOUTS = ["1],[2", "]", "1]", "[1]]", "", " ", "1,2", "[1,]", '{"a":1}}', '1},{"a":2', "[]][", '"a"]["b"',
             "1]]]]]]]],[[[[[[[[2", "[[1]", "\ufeff1", "1 2", "nan", '{"a":1},', ",1"]


@pytest.mark.parametrize("text", BREAKOUTS)
def test_a_text_that_closes_the_wrappers_itself_is_refused_as_alone(text) -> None:
    for data in (text, text.encode()):
        assert outcome(alone, data, 3) == ("invalid",) and outcome(json_nesting._loads_wrapped, data, 3)[0] != "ok"
        assert agrees(data, 3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["[", "]", "{", "}", ",", ":", "1", '"a"', " ", "null"]), max_size=12))
def test_any_bracket_soup_parses_wrapped_exactly_as_alone(pieces) -> None:
    text = "".join(pieces)
    for bound in (0, 1, 2, 5):
        assert agrees(text, bound), (text, bound)
