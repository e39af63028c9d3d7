"""Lineage names, lines and version names (common/lineage.py)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from openjiuwen.agent_evolving.agent_rl.common.lineage import (
    DEFAULT_LINEAGE, LINEAGE_RE, InvalidLineage, is_lineage, line_of, lineage_of_version, lora_name, parse_version_name,
    require_lineage, split_line, version_of,
)


@pytest.mark.parametrize("name", ["default", "support", "a", "user-42", "0", "x" * 63, "v", "v1a", "va1"])
def test_valid_lineage_names(name: str) -> None:
    assert is_lineage(name)
    assert require_lineage(name) == name


@pytest.mark.parametrize("name", ["", "x" * 64, "Support", "a_b", "a.b", "a:b", "a b", "v1", "v20", "é", None, 3])
def test_invalid_lineage_names(name: object) -> None:
    assert not is_lineage(name)
    with pytest.raises(InvalidLineage):
        require_lineage(name)


def test_the_default_lineage_is_named_exactly_as_before_lineages() -> None:
    assert line_of("tiny", DEFAULT_LINEAGE) == "tiny"
    assert lora_name(line_of("tiny", DEFAULT_LINEAGE), 3) == "tiny:v3"
    assert split_line("tiny") == ("tiny", DEFAULT_LINEAGE)
    assert lineage_of_version("tiny:v3", "tiny") == DEFAULT_LINEAGE


def test_a_lineage_line_and_its_versions() -> None:
    line = line_of("org/model-1.5", "support")
    assert line == "org/model-1.5:support"
    assert split_line(line) == ("org/model-1.5", "support")
    name = lora_name(line, 12)
    assert name == "org/model-1.5:support:v12"
    assert parse_version_name(name) == (line, 12)
    assert version_of(name, line) == 12
    assert version_of(name, "org/model-1.5") is None  # a version of another line
    assert lineage_of_version(name, "org/model-1.5") == "support"
    assert lineage_of_version(name, "other") is None


@pytest.mark.parametrize("line", ["tiny:default", "tiny:v1", "tiny:Bad", ":support", "tiny:"])
def test_malformed_lines_are_refused(line: str) -> None:
    with pytest.raises(InvalidLineage):
        split_line(line)


@pytest.mark.parametrize("name", ["tiny", "tiny:v0", "tiny:v01", "tiny:v1:v2", "tiny:default:v1", "tiny:x:y:v1",
                                  "tiny:support:v", "tiny:support:v1 ", 7, None])
def test_malformed_version_names_are_none(name: object) -> None:
    assert parse_version_name(name) is None


def test_version_numbers_are_positive_integers() -> None:
    for bad in (0, -1, True, 1.0):
        with pytest.raises(InvalidLineage):
            lora_name("tiny", bad)  # type: ignore[arg-type]


# Issue 37 item 6: the name grammar and the version parser agree on every name the grammar accepts.
MODEL_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,20}", fullmatch=True)


@given(model=MODEL_IDS, lineage=st.from_regex(LINEAGE_RE, fullmatch=True).filter(is_lineage),
       version=st.integers(min_value=1, max_value=10**6))
@example(model="tiny", lineage="v1-x", version=1)  # `v1` inside the line: the parser read it as the version
@example(model="tiny", lineage="v2v", version=3)
def test_every_accepted_lineage_names_versions_the_parser_reads_back(model: str, lineage: str, version: int) -> None:
    line = line_of(model, lineage)
    name = lora_name(line, version)
    assert split_line(line) == (model, lineage)
    assert parse_version_name(name) == (line, version)
    assert version_of(name, line) == version
    assert lineage_of_version(name, model) == lineage
