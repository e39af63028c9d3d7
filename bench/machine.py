"""What every bench records: facts about the machine it ran on (numbers mean little without them) and its result
file under bench/results/."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import orjson


def machine_facts() -> dict[str, object]:
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
            "load_avg": list(os.getloadavg())}


def write_result(result: Any, out: str | Path) -> Path:
    """Write one bench's result as indented JSON (creating the folder); returns the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return path
