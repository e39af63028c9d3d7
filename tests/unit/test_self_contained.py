"""The repository stands on its own: no tracked file points outside the clone at the sibling `shared` directory.

A clone with nothing beside it must collect and pass its tests and read its docs, so neither code (fixture paths)
nor text (links to the contract) may name the sibling directory the project was developed next to. The contract is
docs/contract.md; the recorded vLLM shapes are tests/fixtures/vllm-0.32-cpu/.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Spelled in pieces so that this file does not match its own search.
_SHARED = "shared"
FORBIDDEN = ("../" + _SHARED, _SHARED + "/docs", _SHARED + "/fixtures")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        # Fail, not skip: the suite runs from a clone (README), and a skipped guard would pass unnoticed.
        pytest.fail(f"cannot list the tracked files ({type(exc).__name__}): run the suite from a git clone")
    return [name for name in out.decode("utf-8", "surrogateescape").split("\0") if name]


def offending(files: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in files:
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, or a submodule entry
            continue
        text = path.read_bytes().decode("utf-8", "replace")  # binaries cannot hide a path in plain ASCII either
        hits = [pattern for pattern in FORBIDDEN if pattern in text]
        if hits:
            found[name] = hits
    return found


def test_no_tracked_file_refers_to_the_sibling_shared_directory() -> None:
    files = tracked_files()
    assert len(files) > 100, "git ls-files listed almost nothing: the check would prove nothing"
    found = offending(files)
    assert not found, (
        "tracked files refer to the sibling shared directory, which a clone does not have (use docs/contract.md "
        "and tests/fixtures/ instead): "
        + "; ".join(f"{name}: {', '.join(hits)}" for name, hits in sorted(found.items()))
    )


def test_the_search_finds_a_reference(tmp_path: Path) -> None:
    """The guard itself: a file naming the sibling directory is reported (a check that finds nothing proves nothing)."""
    named, clean = tmp_path / "named.md", tmp_path / "clean.md"
    named.write_text("see ../" + _SHARED + "/docs/CONTRACT.md\n", encoding="utf-8")
    clean.write_text("see docs/contract.md\n", encoding="utf-8")
    assert offending([str(named), str(clean)]) == {str(named): ["../" + _SHARED, _SHARED + "/docs"]}
