"""What the lineage rounds (lineages.py, family_lineages.py) use of the running demo: a structural type, so they
need not import the driver (run.Demo) that builds them, and the demo package has no import circle."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from .calls import ServiceCalls
from .rounds import Rounds
from .run_report import RunReport
from .stack import Stack


class DemoParts(Protocol):
    run_dir: Path
    stack: Stack
    calls: ServiceCalls
    report: RunReport
    rounds: Rounds

    def stage(self, name: str, log: Path | None) -> AbstractContextManager[None]:  # one driver step (stack.Stage)
        ...
