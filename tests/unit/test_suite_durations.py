"""The durations report (tests/support/durations.py, docs/test-durations.md) reads pytest's own JUnit XML."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_real_junit_file_is_summed_per_folder_and_module(tmp_path: Path) -> None:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "unit" / "__init__.py").write_text("")
    (tmp_path / "tests" / "unit" / "test_a.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(0.3)\n\ndef test_fast():\n    pass\n")
    (tmp_path / "tests" / "unit" / "test_b.py").write_text("def test_one():\n    pass\n")
    junit = tmp_path / "run.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    f"--junitxml={junit}", "tests"], cwd=tmp_path, check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-m", "tests.support.durations", str(junit), "--top", "1"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| folder")
            and not line.startswith("| module")]
    assert rows[0].startswith("| unit | 3 | ")
    assert float(rows[0].split("|")[3]) >= 0.3
    assert rows[1].startswith("| all | 3 | ")
    assert len(rows) == 3 and rows[2].startswith("| tests.unit.test_a | 2 | ")  # --top 1: the slow module only
