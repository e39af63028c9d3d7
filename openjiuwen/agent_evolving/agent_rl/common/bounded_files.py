"""One reader for the small files a process trusts at start-up (configs, key files), and one strict JSON parse for
them: a regular file only (a FIFO would block the open), read with a byte limit (never slurp a huge file), optionally
refused when group or others may read or write it; UTF-8, and JSON with duplicate keys refused (the last one would
silently win). Used by both processes' configs and the key files (issue 39 item 5: the read was written four times,
the parse twice). Callers turn FileReadError into their own config error; no message quotes the content (a key file
holds key material).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

OPEN_TO_OTHERS = stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH  # execute bits do not leak keys
MAX_CONFIG_BYTES = 1024 * 1024  # a config (either process's) is a few KiB


class FileReadError(ValueError):
    """The file (or a key document) cannot be used; the message starts with the caller's `where`."""


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def read_bounded(path: str | os.PathLike[str], where: str, limit: int, *, private_to: str | None = None) -> bytes:
    """The file's bytes, at most `limit` of them.

    :param where: how messages name the file, e.g. ``f"config file {path}"``.
    :param private_to: when set (e.g. "the gateway's user"), refuse a file group or others may read or write
        (checked on the opened file, so a swap between check and read cannot slip through).
    :raises FileReadError: not a regular file, unreadable, too large, or not private when asked.
    """
    path = Path(path)
    try:
        if not path.is_file():  # before opening: a FIFO would block the open
            raise FileReadError(f"{where}: does not exist or is not a regular file")
        with path.open("rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise FileReadError(f"{where}: not a regular file")
            if private_to is not None and info.st_mode & OPEN_TO_OTHERS:
                raise FileReadError(
                    f"{where}: mode {stat.S_IMODE(info.st_mode):04o} lets group or others read or write the keys; "
                    f"make it private to {private_to} (chmod 600)")
            data = handle.read(limit + 1)
    except OSError as exc:
        raise FileReadError(f"{where}: cannot read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > limit:
        raise FileReadError(f"{where}: larger than {limit} bytes")
    return data


def read_text(path: str | os.PathLike[str], where: str, limit: int, *, private_to: str | None = None) -> str:
    """`read_bounded`, decoded as UTF-8.

    :raises FileReadError: as `read_bounded`, or when the bytes are not UTF-8.
    """
    data = read_bounded(path, where, limit, private_to=private_to)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise FileReadError(f"{where}: not valid UTF-8") from None


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_json(data: bytes, where: str) -> Any:
    """A JSON document (a file's bytes, or the gateway's crypto socket answer): UTF-8, duplicate keys refused.

    :raises FileReadError: naming the position and the problem only, never the content.
    """
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_unique_object)
    except UnicodeDecodeError:
        raise FileReadError(f"{where}: not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise FileReadError(f"{where}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except _DuplicateKey as exc:
        raise FileReadError(f"{where}: duplicate key {exc.key!r}") from None
    except RecursionError:  # the stdlib parser recurses per nesting level
        raise FileReadError(f"{where}: JSON nested too deeply") from None


def read_json(path: str | os.PathLike[str], where: str, limit: int, *, private_to: str | None = None) -> Any:
    """`read_bounded`, then `parse_json`: the one reader of a JSON config or key file.

    :raises FileReadError: as either.
    """
    return parse_json(read_bounded(path, where, limit, private_to=private_to), where)
