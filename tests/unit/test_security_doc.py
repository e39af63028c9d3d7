"""docs/security.md names, for each defence, the tests that perform the attack: every one it names must exist.

A renamed or deleted attack test would otherwise leave the page pointing at nothing while it still claims the
defence is proven. References are `tests/…py::test_name`, or `::test_name` after a path in the same table cell.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"
_REF = re.compile(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`")


def referenced_tests(text: str) -> list[tuple[str, str | None]]:
    """(path, test name or None) for each reference, resolving `::name` against the cell's last named path."""
    refs: list[tuple[str, str | None]] = []
    for line in text.splitlines():
        for cell in line.split("|"):
            path = None
            for match in _REF.finditer(cell):
                path = match.group(1) or path
                if path is None:
                    continue
                refs.append((path, match.group(2)))
    return refs


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_test_the_security_page_names_exists() -> None:
    refs = referenced_tests(DOC.read_text(encoding="utf-8"))
    assert len(refs) >= 20, "docs/security.md lost its table of defences and tests"
    missing = []
    for path, name in refs:
        file = ROOT / path
        if not file.is_file():
            missing.append(path)
        elif name is not None and name not in defined_tests(file):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/security.md names tests that do not exist: {', '.join(sorted(set(missing)))}"


def test_the_reference_parser_resolves_shorthand_against_the_cell() -> None:
    text = "| a | `tests/x/test_a.py::test_one`, `::test_two`; `tests/x/test_b.py` | `::test_orphan` |"
    assert referenced_tests(text) == [
        ("tests/x/test_a.py", "test_one"), ("tests/x/test_a.py", "test_two"), ("tests/x/test_b.py", None),
    ]
