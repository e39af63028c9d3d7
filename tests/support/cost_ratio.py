"""Ratio guards for hot paths (issue 38): a path's CPU measured against a reference operation in the same run, so
that the verdict holds on any machine, busy or not.

A regression that only adds CPU (a walk over every parsed body, a second parse) moves the ratio of the path to a
reference that does not change; the speed of the machine, and its load, move both alike. Each round measures a
block of the path and a block of the reference back to back, in alternating order, and the verdict is on the median
of the rounds' ratios, so a round that another process disturbed does not decide it. `bound` is the ratio this
code measured (committed beside the guard, with where it came from); a run fails past `bound * (1 + margin)`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

Block = Callable[[], Awaitable[float]]  # runs one block, returns the CPU seconds it took


@dataclass(frozen=True)
class RatioGuard:
    name: str
    bound: float
    margin: float

    @property
    def limit(self) -> float:
        return self.bound * (1 + self.margin)

    def verdict(self, ratios: list[float]) -> str | None:
        """None when the median ratio is within the limit, else the failure message (every ratio included)."""
        median = statistics.median(ratios)
        if median <= self.limit:
            return None
        shown = ", ".join(f"{r:.2f}" for r in sorted(ratios))
        return (f"{self.name}: median ratio {median:.2f} > {self.limit:.2f} (bound {self.bound} + {self.margin:.0%});"
                f" rounds: {shown}")


async def interleaved_ratios(subject: Block, reference: Block, *, rounds: int) -> list[float]:
    """Per round, subject CPU / reference CPU, the two blocks alternating which runs first."""
    ratios = []
    for i in range(rounds):
        if i % 2:
            ref = await reference()
            cost = await subject()
        else:
            cost = await subject()
            ref = await reference()
        ratios.append(cost / ref)
    return ratios


def thread_cpu() -> float:
    """CPU seconds of the calling thread (ns resolution): an in-process block's own cost, its waits excluded."""
    return time.thread_time()


def process_cpu(pid: int) -> float:
    """CPU seconds of another process, all its threads: /proc/PID/task/*/schedstat (ns) where the kernel keeps it,
    else utime + stime from /proc/PID/stat (clock ticks: blocks then need to last many ticks)."""
    total_ns, found = 0, False
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total_ns += int((task / "schedstat").read_text().split()[0])
            found = True
        except (OSError, ValueError, IndexError):
            continue
    if found and total_ns:
        return total_ns / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
