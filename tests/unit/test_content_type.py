"""Which request bodies count as JSON, and which requests declare a body (common/content_type.py)."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.common.content_type import declares_body, is_json_media_type


@pytest.mark.parametrize("value", [b"application/json", b"application/json; charset=utf-8", b"Application/JSON",
                                   b" application/json ", b"application/vnd.api+json", b"application/merge-patch+json"])
def test_json_types(value: bytes):
    assert is_json_media_type(value)


@pytest.mark.parametrize("value", [b"", b"text/plain", b"text/plain;charset=UTF-8",
                                   b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x",
                                   b"text/json", b"application/jsonp", b"application/+json", b"application", b"json",
                                   b"application/json-seq", b"*/*", b"application/ json"])
def test_other_types(value: bytes):
    assert not is_json_media_type(value)


@pytest.mark.parametrize(("headers", "expected"), [
    ({}, False),
    ({b"content-length": b"0"}, False),
    ({b"content-length": b" 0 "}, False),
    ({b"content-length": b"2"}, True),
    ({b"content-length": b"00"}, True),  # not the plain zero: judged as a body (fail closed)
    ({b"transfer-encoding": b"chunked"}, True),
])
def test_declares_body(headers: dict[bytes, bytes], expected: bool):
    assert declares_body(headers) is expected
