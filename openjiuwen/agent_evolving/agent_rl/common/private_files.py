"""Private files and directories for captured data: the trainer's temporary run directories, logs, LoRA metadata.

Captured prompts and completions must not be readable by other local users, and a directory another user can write
to (or created first by them, as a shared `/tmp` allows) must never hold them: such a user could read a batch or swap
`spec.json` while a trainer starts. So the training root is checked before each use (owned by this process's user,
writable by nobody else, not a symbolic link, every ancestor safe too), each run gets a fresh directory from
`mkdtemp` (0700, unguessable name), and files are created 0600 with `O_EXCL | O_NOFOLLOW`.
All functions are blocking: call them in a worker thread from async code.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class UnsafeDirectoryError(RuntimeError):
    """A directory meant for private data is owned by another user, writable by others, or a symbolic link."""


def _refuse(path: Path, why: str) -> UnsafeDirectoryError:
    return UnsafeDirectoryError(
        f"training_tmp_root {path}: {why}; captured training data is only written to a directory of this service's "
        "own user that nobody else can write to (remove it, or set training_tmp_root to such a directory)"
    )


def _check_ancestors(root: Path) -> None:
    """Whoever can rename an ancestor can put another directory in the root's place: each ancestor must belong to
    root or to us, and be writable by nobody else unless its sticky bit stops renames of others' entries (/tmp)."""
    euid = os.geteuid()
    parent = root.parent.resolve()
    for ancestor in [parent, *parent.parents]:
        st = os.stat(ancestor)
        if st.st_uid not in (0, euid):
            raise _refuse(root, f"its parent directory {ancestor} belongs to another user (uid {st.st_uid})")
        if st.st_mode & _WRITABLE_BY_OTHERS and not st.st_mode & stat.S_ISVTX:
            raise _refuse(root, f"its parent directory {ancestor} is writable by other users")


def ensure_private_root(path: str | os.PathLike[str]) -> Path:
    """Create `path` (0700) if missing, else check it is ours and private; tighten a readable one to 0700.

    :raises UnsafeDirectoryError: owned by another user, writable by group or others, a symlink or not a directory.
    """
    root = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    make_private_dirs(root.parent)
    _check_ancestors(root)
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, DIR_MODE)
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(root, "is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(root, "is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(root, f"belongs to another user (uid {st.st_uid}, this service runs as uid {os.geteuid()})")
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise _refuse(root, f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(root, DIR_MODE, follow_symlinks=False)  # ours and not writable by others: only reads to take away
    return root


def make_run_dir(root: str | os.PathLike[str], prefix: str) -> Path:
    """A fresh private directory `<root>/<prefix><random>` (mode 0700) for one Training Run."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=ensure_private_root(root)))


def private_opener(path: str, flags: int) -> int:
    """`open(..., opener=private_opener)`: a new file is 0600; an existing one of ours is narrowed to 0600."""
    fd = os.open(path, flags | os.O_NOFOLLOW, FILE_MODE)
    with contextlib.suppress(PermissionError):  # not ours: leave its mode, as the operator set it
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, FILE_MODE)
    return fd


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Create `path` with mode 0600 and write `data`; refuses to follow a symlink or reuse an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def make_private_dirs(path: str | os.PathLike[str], mode: int = DIR_MODE) -> None:
    """`mkdir -p` whose newly created directories get `mode` (0700 by default); existing ones are left alone."""
    path = Path(path)
    missing = [p for p in [path, *path.parents] if not p.exists()]
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, mode)
