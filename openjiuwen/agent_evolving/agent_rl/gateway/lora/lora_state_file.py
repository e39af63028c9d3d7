"""The LoRA state file: each line's active version and canary candidate, so that a restarted gateway serves what
it served before (CONTRACT §3.9). Keys are lines (docs/lineages.md): the default lineage's line is the model id, so a
file written before lineages existed reads as the default lines, and a gateway with only the default lineage writes
what it always wrote. Written whole, in one atomic replace, off the event loop; a corrupt file is an
error, never a guess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import orjson

from ...common.lineage import parse_version_name
from .canary import Candidate, parse_candidates
from .lora_types import LoraError

STATE_FILE_VERSION = 1
KEEP: Any = object()  # `write`: leave this part of the model's entry as it is


class LoraStateFile:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._models: dict[str, dict[str, str]] = {}  # the file's content, model → active entry
        self._candidates: dict[str, dict[str, Any]] = {}  # … and its canary candidates, model → entry
        self._lock = asyncio.Lock()

    async def read(self) -> tuple[dict[str, dict[str, str]], dict[str, Candidate]]:
        """(active entry per model, candidate per model); both empty without a file. LoraError 500
        `invalid_lora_state` when the file is corrupt."""
        raw = await asyncio.to_thread(_read_bytes, self.path)
        entries, candidates = _parse(raw) if raw is not None else ({}, {})
        self._models = entries
        self._candidates = {m: c.entry() for m, c in candidates.items()}
        return entries, candidates

    async def write(self, model: str, entry: Any, *, candidate: Any = KEEP) -> None:
        """Write the whole file with this model's active entry and / or candidate changed (`KEEP`: as it is; None:
        removed). OSError when it could not be written (the content kept in memory is unchanged then)."""
        async with self._lock:
            models = _changed(self._models, model, entry)
            candidates = _changed(self._candidates, model, candidate)
            document: dict[str, Any] = {"version": STATE_FILE_VERSION, "models": models}
            if candidates:  # absent without a canary: the file stays what an older gateway reads
                document["candidates"] = candidates
            payload = orjson.dumps(document, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
            await asyncio.to_thread(_atomic_write, self.path, payload)
            self._models, self._candidates = models, candidates


def _changed(current: dict[str, Any], model: str, value: Any) -> dict[str, Any]:
    out = dict(current)
    if value is None:
        out.pop(model, None)
    elif value is not KEEP:
        out[model] = value
    return out


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _parse(raw: bytes) -> tuple[dict[str, dict[str, str]], dict[str, Candidate]]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise LoraError("invalid_lora_state", "the LoRA state file is not valid JSON") from exc
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise LoraError("invalid_lora_state", "the LoRA state file has no `models` object")
    entries: dict[str, dict[str, str]] = {}
    for model, entry in models.items():
        name = entry.get("lora_name") if isinstance(entry, dict) else None
        path = entry.get("lora_path") if isinstance(entry, dict) else None
        parsed = parse_version_name(name)  # also checks that the key is a well-formed line
        if parsed is None or parsed[0] != model or not isinstance(path, str):
            raise LoraError("invalid_lora_state", f"invalid LoRA state entry for {model!r}")
        entries[model] = {k: v for k, v in entry.items() if isinstance(v, str)}
    try:
        candidates = parse_candidates(data.get("candidates"), parse_version_name)
    except ValueError as exc:
        raise LoraError("invalid_lora_state", f"the LoRA state file's candidates: {exc}") from exc
    return entries, candidates


def _atomic_write(path: Path, payload: bytes) -> None:
    """Temp file in the same directory, fsync, rename over the target, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
