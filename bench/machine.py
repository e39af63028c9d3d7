"""Facts about the machine a bench ran on, recorded with every result (numbers mean little without them)."""

from __future__ import annotations

import os
import platform


def machine_facts() -> dict[str, object]:
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
            "load_avg": list(os.getloadavg())}
