"""One reader for the small files a process trusts at start-up (configs, key files): a regular file only (a FIFO
would block the open), read with a byte limit (never slurp a huge file), optionally refused when group or others may
read or write it. Used by both processes' configs and the key files (issue 39 item 5: it was written four times). Callers turn FileReadError into their own config error; the message never quotes the content (a
key file holds key material)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

OPEN_TO_OTHERS = stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH  # execute bits do not leak keys


class FileReadError(ValueError):
    """The file cannot be used; the message starts with the caller's `where`."""


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
