"""The one bounded reader of start-up files (common/bounded_files.py): regular files only, a byte limit, and the
private-mode check for key files, on the opened file; and the one strict JSON parse of configs and key files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.common.bounded_files import FileReadError, read_bounded, read_json, read_text


def test_reads_a_file_up_to_its_limit(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(b"x" * 10)
    assert read_bounded(path, "config", 10) == b"x" * 10
    with pytest.raises(FileReadError, match=r"^config: larger than 9 bytes$"):
        read_bounded(path, "config", 9)


def test_a_fifo_or_a_missing_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(FileReadError, match="does not exist or is not a regular file"):
        read_bounded(fifo, f"key file {fifo}", 100)
    with pytest.raises(FileReadError, match="does not exist or is not a regular file"):
        read_bounded(tmp_path / "nope", "config", 100)


def test_a_private_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_bytes(b"{}")
    path.chmod(0o640)
    assert read_bounded(path, "keys", 100) == b"{}"  # no mode check unless asked
    with pytest.raises(FileReadError, match="mode 0640 lets group or others read or write the keys; make it private "
                                            "to the gateway's user"):
        read_bounded(path, "keys", 100, private_to="the gateway's user")
    path.chmod(0o700)  # execute bits leak nothing
    assert read_bounded(path, "keys", 100, private_to="the gateway's user") == b"{}"


def test_json_is_utf8_without_duplicate_keys_and_never_quoted(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_bytes(b'{"a": {"b": 1}, "c": [1, 2]}')
    assert read_json(path, "keys", 100) == {"a": {"b": 1}, "c": [1, 2]}
    path.write_bytes(b'{"a": {"b": 1, "b": 2}}')  # the last one would silently win
    with pytest.raises(FileReadError, match=r"^keys: duplicate key 'b'$"):
        read_json(path, "keys", 100)
    path.write_bytes(b'{"apiHmacKey": "SECRET')
    with pytest.raises(FileReadError, match=r"^keys: invalid JSON at line 1, column \d+: ") as info:
        read_json(path, "keys", 100)
    assert "SECRET" not in str(info.value)
    path.write_bytes(b'{"a": "\xff"}')
    for read in (read_json, read_text):
        with pytest.raises(FileReadError, match=r"^keys: not valid UTF-8$"):
            read(path, "keys", 100)


def test_json_nested_past_the_parser_depth_is_a_read_error(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_bytes(b"[" * 50_000)  # the stdlib parser would raise RecursionError, which no caller handles
    with pytest.raises(FileReadError, match=r"^keys: JSON nested too deeply$"):
        read_json(path, "keys", 100_000)
