"""The versioned LoRA repository `<root>/<model_id>/v<N>/` (CONTRACT §4.8, D19).

A version appears only by renaming a fully written, fsynced temporary directory, and never replaces an existing
one; temporary and incomplete directories are never counted. The `active` marker is written only after the
gateway confirmed an activation. All file work runs in worker threads, never on the event loop.

Modes: a version is written in a 0700 temporary directory; at publication its directory becomes 0750 and the adapter
files 0640 (vLLM must read them: run it as the service's user or in its group), while `metadata.json` (run ids,
sample counts, rewards) and the `active` marker are 0600, for the service alone. Nothing is readable by others.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ...common.lineage import DEFAULT_LINEAGE, lora_name, split_line

from ...common.ids import now_iso
from ...common.private_files import make_private_dirs

_VERSION_DIR = re.compile(r"v([1-9][0-9]*)")
_RENAME_NOREPLACE = 1
TMP_PREFIX = ".tmp-"
METADATA = "metadata.json"
# What a deleted lineage leaves of its line when its files are removed (docs/lineages.md "Lifecycle"): the number of
# its last version, so a lineage of the same name never publishes a version name vLLM may still hold with other weights.
RETIRED = "retired.json"
MODEL_DIR_MODE = 0o750
VERSION_DIR_MODE = 0o750
ADAPTER_FILE_MODE = 0o640
PRIVATE_FILE_MODE = 0o600


@dataclass(frozen=True, slots=True)
class Artifact:
    lora_name: str
    lora_path: str
    metadata: dict[str, Any] = field(default_factory=dict)


def _renameat2_noreplace() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_RENAMEAT2 = _renameat2_noreplace()
_AT_FDCWD = -100


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename a directory, failing with FileExistsError when `dst` exists (even empty)."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(str(dst))
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), str(dst))
    # Fallback for filesystems without RENAME_NOREPLACE: a small race window, still never replacing content.
    if dst.exists():
        raise FileExistsError(str(dst))
    os.rename(src, dst)


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _private_new_file(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)


def _seal_modes(temp_dir: Path) -> None:
    """The published modes: adapter files readable by the group (vLLM), metadata for the service alone."""
    for root, dirs, files in os.walk(temp_dir):
        for name in files:
            mode = PRIVATE_FILE_MODE if name == METADATA and root == str(temp_dir) else ADAPTER_FILE_MODE
            os.chmod(os.path.join(root, name), mode, follow_symlinks=False)
        for name in dirs:
            os.chmod(os.path.join(root, name), VERSION_DIR_MODE, follow_symlinks=False)
    os.chmod(temp_dir, VERSION_DIR_MODE)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{secrets.token_hex(4)}")
    with open(tmp, "wb", opener=_private_new_file) as fh:
        fh.write(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class LoraRepository:
    def __init__(self, root: str | Path, *, model_id: str, line: str | None = None) -> None:
        self._root = Path(root)
        self._model_id = model_id
        self._line = line or model_id  # the line whose versions this names (docs/lineages.md)

    def for_line(self, line: str | None) -> "LoraRepository":
        """The repository of a line of this model: the default line's is this one, unchanged; another lineage's
        versions live under `<root>/<model_id>/lineages/<lineage>/v<N>` (no `:` in paths), numbered per line."""
        if not line or line == self._line:
            return self
        return LoraRepository(self._root, model_id=self._model_id, line=line)

    @property
    def model_dir(self) -> Path:
        model, lineage = split_line(self._line)
        base = self._root / self._model_id
        return base if lineage == DEFAULT_LINEAGE else base / "lineages" / lineage

    def version_path(self, version: int) -> Path:
        return self.model_dir / f"v{version}"

    def lora_name(self, version: int) -> str:
        return lora_name(self._line, version)

    # ---------------------------------------------------------------- sync core (run in threads)

    def complete_versions(self) -> list[int]:
        """Versions whose directory holds `metadata.json`; temporary and incomplete directories never count."""
        if not self.model_dir.is_dir():
            return []
        out = []
        for entry in self.model_dir.iterdir():
            m = _VERSION_DIR.fullmatch(entry.name)
            if m and entry.is_dir() and (entry / METADATA).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def create_temp_sync(self, run_id: str) -> Path:
        make_private_dirs(self.model_dir, MODEL_DIR_MODE)
        path = self.model_dir / f"{TMP_PREFIX}{run_id}-{secrets.token_hex(4)}"
        path.mkdir(mode=0o700)  # private while the trainer writes; published 0750 (_seal_modes)
        return path

    def publish_sync(self, temp_dir: Path, metadata: dict[str, Any]) -> Artifact:
        """Write metadata.json into `temp_dir`, fsync everything, rename to the next free `v<N>`."""
        temp_dir = Path(temp_dir)
        if temp_dir.parent != self.model_dir or not temp_dir.name.startswith(TMP_PREFIX):
            raise ValueError("publish takes a temporary directory created by this repository")
        floor = 0
        for _ in range(100):
            # 1 + the largest complete version; past any name that was taken on a previous try (a concurrent
            # publisher, or an incomplete directory that must not be replaced).
            version = max((self.complete_versions() or [0])[-1] + 1, self._retired_last() + 1, floor + 1)
            floor = version
            meta = dict(metadata, version=version, lora_name=self.lora_name(version), model_id=self._model_id,
                        user_id=self._model_id)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_dir / METADATA)  # a previous try's: the new one is created 0600 again
            with open(temp_dir / METADATA, "wb", opener=_private_new_file) as fh:
                fh.write(orjson.dumps(meta, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
            _seal_modes(temp_dir)
            _fsync_tree(temp_dir)
            target = self.version_path(version)
            try:
                _rename_noreplace(temp_dir, target)
            except FileExistsError:
                continue  # another publisher took v<N> (or an incomplete dir sits there): recompute N
            _fsync_dir(self.model_dir)
            return Artifact(self.lora_name(version), str(target.resolve()), meta)
        raise RuntimeError("could not find a free version directory")

    def _retired_last(self) -> int:
        """The last version number of a deleted lineage of this line, 0 when none was removed."""
        try:
            last = orjson.loads((self.model_dir / RETIRED).read_bytes()).get("last_version")
        except (OSError, orjson.JSONDecodeError, AttributeError):
            return 0
        return last if isinstance(last, int) and not isinstance(last, bool) and last > 0 else 0

    def retire_sync(self) -> int:
        """Remove every version (and temporary directory) of this non-default line, keeping only the number of its
        last version (`RETIRED`); returns that number. Idempotent; links are removed, never followed."""
        if split_line(self._line)[1] == DEFAULT_LINEAGE:
            raise ValueError("the default line's versions are never retired")
        if self.model_dir.is_symlink():
            self.model_dir.unlink()
        if not self.model_dir.is_dir():
            return 0
        last = max([self._retired_last(), *self.complete_versions()])
        _write_json_atomic(self.model_dir / RETIRED, {"last_version": last})
        for entry in self.model_dir.iterdir():
            if entry.name == RETIRED:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        _fsync_dir(self.model_dir)
        return last

    def remove_temp_sync(self, run_id: str) -> int:
        """Remove every temporary directory of a run (failed, canceled or interrupted)."""
        if not self.model_dir.is_dir():
            return 0
        removed = 0
        for entry in self.model_dir.glob(f"{TMP_PREFIX}{run_id}-*"):
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
        return removed

    def write_active_sync(self, lora_name: str, lora_path: str, training_run_id: str) -> None:
        make_private_dirs(self.model_dir, MODEL_DIR_MODE)
        _write_json_atomic(
            self.model_dir / "active",
            {"lora_name": lora_name, "lora_path": lora_path, "training_run_id": training_run_id,
             "activated_at": now_iso()},
        )

    # ---------------------------------------------------------------- async façade

    async def create_temp(self, run_id: str) -> Path:
        return await asyncio.to_thread(self.create_temp_sync, run_id)

    async def publish(self, temp_dir: Path, metadata: dict[str, Any]) -> Artifact:
        return await asyncio.to_thread(self.publish_sync, temp_dir, metadata)

    async def remove_temp(self, run_id: str) -> int:
        return await asyncio.to_thread(self.remove_temp_sync, run_id)

    async def write_active(self, lora_name: str, lora_path: str, training_run_id: str) -> None:
        await asyncio.to_thread(self.write_active_sync, lora_name, lora_path, training_run_id)

    def validate_artifact(self, artifact: Artifact) -> None:
        """CONTRACT §4.7: name `<model_id>:v<N>`, path `<root>/<model_id>/v<N>` (same N), with metadata.json."""
        prefix = f"{self._line}:v"
        suffix = artifact.lora_name[len(prefix):] if artifact.lora_name.startswith(prefix) else ""
        if not _VERSION_DIR.fullmatch(f"v{suffix}"):
            raise ValueError(f"invalid artifact name {artifact.lora_name!r}")
        expected = self.version_path(int(suffix)).resolve()
        if Path(artifact.lora_path).resolve() != expected:
            raise ValueError(f"artifact path {artifact.lora_path} is not {expected}")
        if not (expected / METADATA).is_file():
            raise ValueError(f"artifact {artifact.lora_name} has no metadata.json")
